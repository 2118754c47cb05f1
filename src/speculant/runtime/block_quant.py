"""A linear layer that runs a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weight as it is: the file's
own codes and its own fp16 scales (and mins), exact in fp32 (``kernels.int4_gemm_f32``), not a
second quantization of its de-quantized weights. Rows are computed on their own like every int4
layer of speculant's (a tree's rows get bit for bit what one-row passes get), and every x86 code
path gives the same bits.

Each group of 32 inputs has ``w = u * scale + offset`` with an unsigned code u
(``runtime.gguf_blocks.legacy_blocks``): 4-bit codes (Q4_0, Q4_1) run in one call; 5-bit codes (Q5_0,
Q5_1) in one call with a plane of fifth bits; Q8_0's 8-bit codes u = q + 128 as two 4-bit planes,
``u = lo + 16 hi``, two calls whose fp32 results are added:
``y = x @ (lo * d - 128 d).T + x @ (hi * 16 d).T`` (16 d is exact). The sum is taken in the same
order for every row, so the layer stays row-invariant and path-independent.

Shapes: ``qweight`` (N/16, K/8, 64) uint8 the codes' low 4 bits, ``sf`` (N/16, K/32, 2, 16) float32
each group's (scale, offset), ``qh`` (N/16, K/32, 64) uint8 the fifth bits (5-bit codes; else empty),
``qweight_hi`` and ``sf_hi`` Q8_0's high plane (else empty): ``kernels.pack_f32scales_x86``'s.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import INT4_ISAS, pack_f32scales_x86, unpack_int4_x86, unpack_q5k_x86, x86_kernels
from .block_linear import BlockLinear
from .gguf_blocks import LEGACY, legacy_blocks

__all__ = ["BlockQuantLinear"]

_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)


class BlockQuantLinear(BlockLinear):
    """y = x @ W.T + b with W a GGUF Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 tensor's weights (module
    docstring), activations rounded to int8 per group of 32 as in every int4 layer here."""

    def __init__(self, kind: str, parts: dict[str, torch.Tensor], bias32: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16):
        full = {"qweight": parts["qweight"], "sf": parts["sf"], "qh": parts.get("qh", _EMPTY_U8),
                "qweight_hi": parts.get("qweight_hi", _EMPTY_U8),
                "sf_hi": parts.get("sf_hi", torch.empty(0))}
        super().__init__(full, bias32, dtype, parts["qweight"].shape[1] * 8)
        self.kind = kind

    @classmethod
    def from_blocks(cls, raw: np.ndarray, bias: torch.Tensor | None = None, rows: np.ndarray | None = None,
                    dtype: torch.dtype = torch.bfloat16, kind: str = "Q8_0") -> "BlockQuantLinear":
        """The layer of a ``kind`` tensor's raw bytes (N, K / 32 * block bytes) (``GGUFReader``'s
        ``data``); ``rows``: the order of the output channels (a permutation of N), None for the
        file's own; ``bias`` (N,)."""
        codes, scale, offset = legacy_blocks(raw, kind)
        if rows is not None:
            codes, scale, offset = codes[rows], scale[rows], offset[rows]
        q, s, o = (torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scale, offset))
        bias32 = None if bias is None else bias.detach().float().contiguous()
        bits = LEGACY[kind][1]
        if bits < 8:
            qweight, sf, qh = pack_f32scales_x86(q, s, o, bits)
            return cls(kind, {"qweight": qweight, "sf": sf, "qh": qh}, bias32, dtype)
        qweight, sf, _ = pack_f32scales_x86(q & 15, s, o)
        qweight_hi, sf_hi, _ = pack_f32scales_x86(q >> 4, s * 16, torch.zeros_like(o))
        return cls(kind, {"qweight": qweight, "sf": sf, "qweight_hi": qweight_hi, "sf_hi": sf_hi}, bias32, dtype)

    def from_parts(self, parts: dict[str, torch.Tensor], bias32: torch.Tensor | None) -> "BlockQuantLinear":
        return BlockQuantLinear(self.kind, parts, bias32, self.dtype)

    def _run(self, x2: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        k, isa = x86_kernels(), INT4_ISAS[self._isa]
        if not self.qweight_hi.numel():
            return k.int4_gemm_f32(x2, self.qweight, self.sf, self.qh, self.bias32, out_fp32, isa)
        y = k.int4_gemm_f32(x2, self.qweight, self.sf, self.qh, self.bias32, True, isa)
        y = y + k.int4_gemm_f32(x2, self.qweight_hi, self.sf_hi, self.qh, torch.empty(0), True, isa)
        return y if out_fp32 else y.to(self.dtype)

    def _run_prefill(self, amx, x2: torch.Tensor) -> torch.Tensor:
        if not self.qweight_hi.numel():
            return amx.f32_prefill_mm(x2, self.qweight, self.sf, self.qh, self.bias32, False)
        y = amx.f32_prefill_mm(x2, self.qweight, self.sf, self.qh, self.bias32, True)
        y = y + amx.f32_prefill_mm(x2, self.qweight_hi, self.sf_hi, self.qh, torch.empty(0), True)
        return y.to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight in float32: the file's own (the same values as gguf-py's)."""
        nb, G = self.sf.shape[0], self.sf.shape[1]
        codes = unpack_q5k_x86(self.qweight, self.qh) if self.qh.numel() else unpack_int4_x86(self.qweight)
        if self.qweight_hi.numel():
            codes = codes.to(torch.int32) | (unpack_int4_x86(self.qweight_hi).to(torch.int32) << 4)
        s = self.sf[:, :, 0].permute(0, 2, 1).reshape(nb * 16, G, 1)
        o = self.sf[:, :, 1].permute(0, 2, 1).reshape(nb * 16, G, 1)
        return (codes.float().view(nb * 16, G, 32) * s + o).view(nb * 16, G * 32)
