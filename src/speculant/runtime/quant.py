"""Weight-only quantization of Linear layers (int8 per channel, int4 per group) for CPU.

Decoding one token is bound by the bytes of weights read, so fewer bytes per weight is speed.
A quantized *draft* costs nothing in output quality: the target verifies every token, so the
output stays exactly the target's; only the acceptance rate can move. Quantizing the target
changes its outputs (a user's choice, measured separately).

Kernels: int4 uses speculant's own kernels where they run (``speculant.kernels``: int4 weights
x int8 activations, rows computed independently, cost close to flat over a few rows); otherwise,
and for int8, PyTorch's CPU weight-only matmuls (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``), whose cost grows linearly with the rows of x while a dense
bf16 matmul costs about the same for 1 or 16 rows. So each such layer keeps its dense weight too
(memory is not the limit, bandwidth is) and inputs of more than ``dense_above_rows`` (4) rows take
the dense path; speculant's int4 kernel takes every width itself.

``keep_dense=False`` drops that dense weight (the memory-lean choice for a large target whose
dense copy would double its footprint): inputs of up to ``max_kernel_rows`` rows use the quantized
kernel, larger ones (prefill) dequantize the weight into a temporary dense matrix for that one call
(int8 above 32 rows, PyTorch int4 above 192; speculant's int4 kernel is used at every width).
Why these thresholds: docs/design-notes.md#quantized-layers-row-thresholds
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .packing import unpack_linears
from .weights import LinearWeights
from ..kernels import GROUP, INT4_ISAS, amx_kernels, dequantize_int4_x86, int4_isa, pack_int4_x86, x86_kernels

QUANT_MODES = ("none", "int8", "int4")
_NO_BIAS = torch.empty(0)
DENSE_ABOVE_ROWS = 4


class _WeightOnly(LinearWeights, nn.Module):
    """Shared forward: quantized kernel for few rows, the dense weight for many. Its weights, dense
    or quantized, are read through the :class:`~speculant.runtime.weights.LinearWeights` protocol."""

    max_kernel_rows = 32  # without a dense weight: above this many rows, dequantize for the call
    dense_above_rows = DENSE_ABOVE_ROWS  # with a dense weight: above this many rows, use it

    def __init__(self, linear: nn.Linear, keep_dense: bool = True):
        super().__init__()
        # dense (N, K), shared with the original layer (no copy), or None when not kept
        self.weight = linear.weight if keep_dense else None
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  # of the activations it takes and returns

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.weight is not None and x2.shape[0] > self.dense_above_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.weight is None and x2.shape[0] > self.max_kernel_rows:
            return nn.functional.linear(x, self.dequantize(), self.bias)
        y = self._quantized(x2).view(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8Linear(_WeightOnly):
    """y = x @ (q * scale).T + b with q int8 (N, K), one scale per output channel."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = True):
        super().__init__(linear, keep_dense)
        w = linear.weight.detach().float()  # (N, K)
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.scale.dtype).mul_(self.scale[:, None])


class Int4Linear(_WeightOnly):
    """Asymmetric int4 with one (scale, offset) per ``group_size`` input channels:
    w ≈ q * scale + offset, q in [0, 15].

    Two kernels (``kind``):

    - ``"x86"``: speculant's kernel for every x86-64 CPU (``kernels/int4_x86.cpp``: AVX-512 VNNI,
      AVX2 with or without AVX-VNNI, or portable C++, and on AMX CPUs AMX tiles for passes of 10
      rows or more; ``SPECULANT_INT4_ISA`` forces one path);
    - ``"torch"``: PyTorch's ``_weight_int4pack_mm_for_cpu`` (bf16 activations; cost linear in
      the rows), where speculant's kernel does not build (or the shape does not fit its layout).

    speculant's kernel reads each weight once per pass for up to 16-32 rows, so a tree verification
    pass costs little more than one token, and computes every row on its own (a row's result does
    not depend on the other rows); activations are quantized to int8 per row and group (as
    llama.cpp does). Every code path gives the same bits, so the output does not depend on which
    x86 CPU runs it.
    """

    max_kernel_rows = 192

    def __init__(self, linear: nn.Linear, group_size: int = 64, keep_dense: bool = True):
        super().__init__(linear, keep_dense)
        n, k = linear.weight.shape
        if k % group_size:
            raise ConfigError(f"int4 needs in_features divisible by {group_size}, got {k}")
        self.group_size = group_size
        self._isa = int4_isa() if n % 16 == 0 and group_size % 16 == 0 else None
        self.kind = "x86" if self._isa is not None else "torch"
        if self.kind == "x86":  # speculant's layout, made 4096 rows at a time (bounded memory: a
            packed = []         # 152k x 1536 output layer in float32 would be 0.9 GB)
            for r in range(0, n, 4096):
                q, scale, lo = _int4_codes(linear.weight[r:r + 4096], group_size)
                packed.append(pack_int4_x86(q, scale[..., 0], lo[..., 0]))
            self.register_buffer("qweight", torch.cat([p[0] for p in packed]))
            self.register_buffer("scales_zeros", torch.cat([p[1] for p in packed]))
            # forward runs the kernel at every width, prefill included: no dense path, no dequantizing
            self.dense_above_rows = self.max_kernel_rows = 1 << 62
        else:  # PyTorch's layout: w = (q - 8) * scale + zero
            q, scale, lo = _int4_codes(linear.weight, group_size)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            sz = torch.cat([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
            self.register_buffer("scales_zeros", sz.to(linear.weight.dtype))
        self.bias32 = linear.bias.detach().float().contiguous() if linear.bias is not None else torch.empty(0)

    @classmethod
    def from_packed(cls, qweight: torch.Tensor, scales: torch.Tensor, bias32: torch.Tensor | None, kind: str,
                    in_features: int, dtype: torch.dtype = torch.bfloat16, group_size: int = GROUP) -> "Int4Linear":
        """A layer over already packed weights (speculant's layout, ``kind`` "x86"; e.g. read from a
        saved model). The tensors are used as they are (no copy)."""
        if kind != "x86":
            raise ValueError(f"from_packed takes speculant's x86 layout, not {kind!r}")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.weight, out.bias = None, None
        out.in_features, out.dtype, out.group_size = in_features, dtype, group_size
        out.out_features = qweight.shape[0] * 16
        out.kind = kind
        out._isa = int4_isa()
        if out._isa is None:
            raise ConfigError("these int4 weights are packed for speculant's x86 kernel, which does not run here")
        out.dense_above_rows = out.max_kernel_rows = 1 << 62
        out.register_buffer("qweight", qweight)
        out.register_buffer("scales_zeros", scales)
        out.bias32 = bias32 if bias32 is not None else torch.empty(0)
        return out

    @classmethod
    def concat(cls, layers: "list[Int4Linear]") -> "Int4Linear":
        """One layer computing ``layers`` side by side (outputs concatenated), e.g. q, k and v
        projections as one call: the same weights, so the same bits per output (speculant's kernel
        computes every channel on its own). Only for speculant's layout, without dense weights.
        ``layers`` become views of the joined layer's buffers (no second copy of the weights)."""
        first = layers[0]
        if any(lin.kind != first.kind or lin.kind == "torch" or lin.weight is not None
               or lin.in_features != first.in_features or lin.dtype != first.dtype
               or lin.group_size != first.group_size or lin.out_features % 16 for lin in layers):
            raise ValueError("concat needs int4 layers of speculant's layout, one input size, no dense weights")
        biases = [lin.bias32 if lin.bias32.numel() else torch.zeros(lin.out_features) for lin in layers]
        bias = torch.cat(biases) if any(lin.bias32.numel() for lin in layers) else None
        out = cls.from_packed(torch.cat([lin.qweight for lin in layers]),
                              torch.cat([lin.scales_zeros for lin in layers]),
                              bias, first.kind, first.in_features, first.dtype, first.group_size)
        start = 0
        for lin in layers:
            part = out.rows(start, start + lin.out_features)
            lin.qweight, lin.scales_zeros, lin.bias32 = part.qweight, part.scales_zeros, part.bias32
            lin.bias = None  # the float32 bias, a view of the joined one, is added by the kernel
            start += lin.out_features
        return out

    def rows(self, start: int, stop: int) -> "Int4Linear":
        """Output channels start .. stop-1 (multiples of 16) as a layer sharing this one's buffers."""
        if start % 16 or stop % 16 or not 0 <= start < stop <= self.out_features or self.kind == "torch":
            raise ValueError(f"rows({start}, {stop}): multiples of 16 within {self.out_features}, speculant's layout")
        bias = self.bias32[start:stop] if self.bias32.numel() else None
        return Int4Linear.from_packed(self.qweight[start // 16:stop // 16], self.scales_zeros[start // 16:stop // 16],
                                      bias, self.kind, self.in_features, self.dtype, self.group_size)

    def _x86(self, x2: torch.Tensor, out_fp32: bool, bias: bool = True) -> torch.Tensor:
        """(M, K) -> (M, N) through int4_x86.cpp, the bias added in float32 (if ``bias``)."""
        return x86_kernels().int4_gemm(x2.contiguous(), self.qweight, self.scales_zeros,
                                       self.bias32 if bias else _NO_BIAS, out_fp32, INT4_ISAS[self._isa])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "x86":
            return super().forward(x)
        shape = x.shape
        return self._x86(x.reshape(-1, shape[-1]).to(self.dtype), False).view(*shape[:-1], self.out_features)

    def forward_prefill(self, x: torch.Tensor) -> torch.Tensor:
        """forward for prompt rows (``ForwardRequest.prefill``): on AMX CPUs, where the int4
        matmul's own path is ``amx``, the weights widened to bf16 on AMX tiles
        (``kernels/int4_prefill_amx.cpp``: ~1.6x faster from ~100 rows on, not ``forward``'s
        bits; every row still on its own); elsewhere ``forward``."""
        kernels = amx_kernels() if self.kind == "x86" and self._isa == "amx" else None
        if kernels is None:
            return self(x)
        shape = x.shape
        y = kernels.int4_prefill_mm(x.reshape(-1, shape[-1]).to(self.dtype).contiguous(), self.qweight,
                                    self.scales_zeros, self.bias32, False)
        return y.view(*shape[:-1], self.out_features)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward in float32 (the output layer's logits: no bf16 rounding of the result)."""
        if self.kind != "x86":
            return self(x).float()
        shape = x.shape
        return self._x86(x.reshape(-1, shape[-1]).to(self.dtype), True).view(*shape[:-1], self.out_features)

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:  # PyTorch's layout (forward runs speculant's)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        if self.kind == "x86":
            return dequantize_int4_x86(self.qweight, self.scales_zeros, self.scales_zeros.dtype)
        n, k = self.out_features, self.in_features
        q = unpack_int4(self.qweight, n, k).view(n, k // self.group_size, self.group_size)
        scale, zero = self.scales_zeros.transpose(0, 1).contiguous().unbind(-1)  # (N, G) each
        offset = (zero - 8 * scale).unsqueeze(-1)  # w = q * scale + (zero - 8 scale)
        return torch.addcmul(offset, q.to(scale.dtype), scale.unsqueeze(-1)).view(n, k)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (R,) of the dense matrix the quantized weight stands for: (R, K)."""
        if self.kind == "x86":
            return dequantize_int4_x86(self.qweight, self.scales_zeros, self.scales_zeros.dtype, rows)
        return self.dequantize()[rows]


def _int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (n, K) -> codes q (n, K) int32 in [0, 15], scale and lo (n, K / group, 1) float32
    with w ~ q * scale + lo (asymmetric, per group of ``group_size`` inputs)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)  # (n, G, 1)
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo


def _unpack_int4_blocked(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """PyTorch's CPU int4 layout (AVX-512 build, found by probing ``_convert_weight_to_int4pack_
    for_cpu``): output channels in blocks of 64; byte (block, k, j) holds channel j in its low
    nibble and channel j + 32 in its high nibble. Returns q (N, K) uint8 in [0, 15]."""
    t = packed.view(n // 64, k, 32)
    q = torch.cat([t & 15, t >> 4], dim=-1)  # (N/64, K, 64)
    return q.transpose(1, 2).reshape(n, k)


_INT4_LAYOUT_OK: bool | None = None


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """q (N, K) from the kernel's packed weight. The layout is an implementation detail of the
    kernel (it differs per CPU build), so it is checked once against the kernel on a probe matrix;
    if it does not match, dequantize through the kernel itself (slow but exact)."""
    global _INT4_LAYOUT_OK
    if _INT4_LAYOUT_OK is None:
        probe = torch.randint(0, 16, (128, 128), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        try:
            back = _unpack_int4_blocked(torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1), 128, 128)
            _INT4_LAYOUT_OK = torch.equal(back.to(torch.int32), probe)
        except RuntimeError:
            _INT4_LAYOUT_OK = False
    if _INT4_LAYOUT_OK and n % 64 == 0:
        return _unpack_int4_blocked(packed, n, k)
    # fallback: the kernel applied to the identity gives w = (q - 8) * 1 + 8 with unit scales
    ones = torch.ones(k // 32, n, 2, dtype=torch.bfloat16)
    ones[..., 1] = 8.0
    eye = torch.eye(k, dtype=torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, ones).t().round().to(torch.uint8)


def quantize_linear(linear: nn.Linear, mode: str, group_size: int = 64, keep_dense: bool = True) -> nn.Module:
    """One quantized replacement for ``linear`` (``mode`` "int8" or "int4")."""
    if mode == "int8":
        return Int8Linear(linear, keep_dense)
    if mode == "int4":
        return Int4Linear(linear, group_size, keep_dense)
    raise ConfigError(f"unknown quantization {mode!r}: choose one of int8, int4")


def quantize_linears(model: nn.Module, mode: str, group_size: int = 64) -> nn.Module:
    """Replace every nn.Linear of ``model`` (the output layer included) in place; returns model."""
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {mode!r}: choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    unpack_linears(model)  # plain nn.Linear layers to quantize (a no-op unless an HFBackend packed them)
    dtype = next(model.parameters()).dtype
    if mode == "int4" and dtype != torch.bfloat16:
        raise ConfigError("int4 weights need a bfloat16 model: load it with dtype='bfloat16'")
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Int8Linear(mod) if mode == "int8" else Int4Linear(mod, group_size)
        setattr(parent, child, new)
    return model


def joined(layers: list[nn.Module]) -> nn.Module | None:
    """:meth:`Int4Linear.concat` of ``layers`` (e.g. q, k and v projections: one kernel call, the
    same bits) if they are int4 layers of speculant's layout it can join, else None."""
    if all(isinstance(lin, Int4Linear) and lin.kind != "torch" and lin.weight is None for lin in layers):
        return Int4Linear.concat(layers)
    return None
