"""A linear layer that runs a GGUF file's Q4_K, Q5_K or Q6_K weight as it is: the file's own codes
and its own scales (``kernels.int4_gemm_kquant``, ``int4_gemm_q5k``, ``int4_gemm_q6k``), not a second
quantization of its de-quantized weights. Rows are computed on their own like every int4 layer of
speculant's (a tree's rows get bit for bit what one-row passes get), and every x86 code path gives
the same bits.

Shapes, Q4_K: ``qweight`` (N/16, K/8, 64) uint8, ``kd`` (N/16, K/256, 2, 16) float32 (each block's d
and -dmin), ``km`` (N/16, K/32, 2, 16) uint8 (each group's 6-bit scale and min): ``pack_kquant_x86``'s.
Q5_K: Q4_K's with ``qweight`` the low 4 bits of 5-bit codes and ``qh`` (N/16, K/32, 64) uint8 their
fifth bits (``pack_q5k_x86``'s).
Q6_K: ``qweight`` the low 4 bits of each code + 32, ``qh`` (N/16, K/16, 64) uint8 its high 2 bits,
``kd`` (N/16, K/256, 16) float32 (each block's d), ``km`` (N/16, K/16, 16) int8 (each group's scale):
``pack_q6k_x86``'s.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..kernels import (INT4_ISAS, int4_isa, pack_kquant_x86, pack_q5k_x86, pack_q6k_x86, unpack_int4_x86,
                       unpack_q5k_x86, unpack_q6k_x86, x86_kernels)

__all__ = ["KQuantLinear"]

_NO_BIAS = torch.empty(0)
KINDS = ("Q4_K", "Q5_K", "Q6_K")  # the GGUF types this layer runs as they are


class KQuantLinear(nn.Module):
    """y = x @ W.T + b with W a Q4_K or Q5_K tensor's weights, w = q * (d * sc) + (-dmin) * m per
    group of 32 inputs (q in 0..15, 0..31), or a Q6_K tensor's, w = (d * sc) * q per group of 16
    (q in -32..31), in fp32;
    activations rounded to int8 per group as in every int4 layer here."""

    def __init__(self, qweight: torch.Tensor, kd: torch.Tensor, km: torch.Tensor, bias32: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16, qh: torch.Tensor | None = None):
        super().__init__()
        self._isa = int4_isa()
        if self._isa is None:
            raise ConfigError("a GGUF file's k-quant weights run on speculant's x86 kernels, which do not run here "
                              "(not x86, no C++ compiler, or SPECULANT_NO_KERNELS): use target_quant int4")
        self.register_buffer("qweight", qweight)
        self.register_buffer("kd", kd)
        self.register_buffer("km", km)
        self.register_buffer("qh", qh if qh is not None else torch.empty(0, dtype=torch.uint8))
        self.kind = "Q4_K" if qh is None else "Q6_K" if kd.dim() == 3 else "Q5_K"
        self.bias32 = bias32 if bias32 is not None else torch.empty(0)
        self.out_features, self.in_features = qweight.shape[0] * 16, qweight.shape[1] * 8
        self.dtype = dtype
        self.weight, self.bias = None, None  # no dense weight: the kernel takes every width

    @classmethod
    def from_blocks(cls, raw: np.ndarray, bias: torch.Tensor | None = None, rows: np.ndarray | None = None,
                    dtype: torch.dtype = torch.bfloat16, kind: str = "Q4_K") -> "KQuantLinear":
        """The layer of a ``kind`` (Q4_K, Q5_K or Q6_K) tensor's raw bytes (N, K / 256 * block bytes)
        (``GGUFReader``'s ``data``); ``rows``: the order of the output channels (a permutation of
        N, e.g. the inverse of the q/k permutation llama.cpp's converter applies), None for the
        file's own; ``bias`` (N,)."""
        from ..store.gguf_blocks import q4_k_blocks, q5_k_blocks, q6_k_blocks

        if kind not in KINDS:
            raise ValueError(f"KQuantLinear runs {', '.join(KINDS)} blocks, not {kind}")
        parts = {"Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks}[kind](raw)
        if rows is not None:
            parts = tuple(p[rows] for p in parts)
        parts = [torch.from_numpy(np.ascontiguousarray(p)) for p in parts]
        bias32 = None if bias is None else bias.detach().float().contiguous()
        if kind != "Q4_K":
            qweight, qh, kd, km = (pack_q6k_x86 if kind == "Q6_K" else pack_q5k_x86)(*parts)
            return cls(qweight, kd, km, bias32, dtype, qh)
        qweight, kd, km = pack_kquant_x86(*parts)
        return cls(qweight, kd, km, bias32, dtype)

    @classmethod
    def concat(cls, layers: "list[KQuantLinear]") -> "KQuantLinear":
        """One layer computing ``layers`` side by side (e.g. q, k and v: one kernel call, the same
        bits per output); ``layers`` become views of its buffers."""
        first = layers[0]
        if any(l.in_features != first.in_features or l.dtype != first.dtype or l.kind != first.kind for l in layers):
            raise ValueError("concat needs k-quant layers of one type, input size and dtype")
        bias = (torch.cat([l.bias32 if l.bias32.numel() else torch.zeros(l.out_features) for l in layers])
                if any(l.bias32.numel() for l in layers) else None)
        out = cls(torch.cat([l.qweight for l in layers]), torch.cat([l.kd for l in layers]),
                  torch.cat([l.km for l in layers]), bias, first.dtype,
                  torch.cat([l.qh for l in layers]) if first.kind != "Q4_K" else None)
        start = 0
        for l in layers:
            part = out.rows(start, start + l.out_features)
            l.qweight, l.kd, l.km, l.qh, l.bias32 = part.qweight, part.kd, part.km, part.qh, part.bias32
            start += l.out_features
        return out

    def rows(self, start: int, stop: int) -> "KQuantLinear":
        """Output channels start .. stop-1 (multiples of 16) as a layer sharing this one's buffers."""
        if start % 16 or stop % 16 or not 0 <= start < stop <= self.out_features:
            raise ValueError(f"rows({start}, {stop}): multiples of 16 within {self.out_features}")
        a, b = start // 16, stop // 16
        bias = self.bias32[start:stop] if self.bias32.numel() else None
        return self._part(slice(a, b), bias)

    def _part(self, blocks, bias: torch.Tensor | None) -> "KQuantLinear":
        """The layer of the channel blocks ``blocks`` (a slice or an index tensor) of this one."""
        return KQuantLinear(self.qweight[blocks], self.kd[blocks], self.km[blocks], bias, self.dtype,
                            self.qh[blocks] if self.kind != "Q4_K" else None)

    def _run(self, x: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype).contiguous()
        isa = INT4_ISAS[self._isa]
        if self.kind != "Q4_K":
            run = x86_kernels().int4_gemm_q6k if self.kind == "Q6_K" else x86_kernels().int4_gemm_q5k
            y = run(x2, self.qweight, self.qh, self.kd, self.km, self.bias32, out_fp32, isa)
        else:
            y = x86_kernels().int4_gemm_kquant(x2, self.qweight, self.kd, self.km, self.bias32, out_fp32, isa)
        return y.view(*shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N) in the activation dtype
        return self._run(x, False)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward in float32 (the output layer's logits: no bf16 rounding of the result)."""
        return self._run(x, True)

    forward_prefill = forward  # no prefill kernel of its own: prompt rows take the same path

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight in float32: the file's own, bit for bit."""
        nb, G = self.km.shape[0], self.km.shape[1]
        if self.kind == "Q6_K":
            q = unpack_q6k_x86(self.qweight, self.qh).float().view(nb * 16, G, 16)
            s = (self.kd.repeat_interleave(16, 1) * self.km.float()).permute(0, 2, 1).reshape(nb * 16, G, 1)
            return (q * s).view(nb * 16, G * 16)
        codes = unpack_q5k_x86(self.qweight, self.qh) if self.kind == "Q5_K" else unpack_int4_x86(self.qweight)
        q = codes.float().view(nb * 16, G, 32)
        d = self.kd.repeat_interleave(8, 1)  # (nb, G, 2, 16)
        s = (d[:, :, 0] * self.km[:, :, 0].float()).permute(0, 2, 1).reshape(nb * 16, G, 1)
        o = (d[:, :, 1] * self.km[:, :, 1].float()).permute(0, 2, 1).reshape(nb * 16, G, 1)
        return (q * s + o).view(nb * 16, G * 32)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (R,) of the weight, (R, K) in the activation dtype (only their blocks of 16
        are de-quantized: an output layer's draft-vocabulary rows without the whole matrix)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        blocks, inverse = torch.unique(rows // 16, return_inverse=True)
        part = self._part(blocks, None).dequantize()
        return part[inverse * 16 + rows % 16].to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} as in the file"

