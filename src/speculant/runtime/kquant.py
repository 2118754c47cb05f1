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

from ..kernels import (INT4_ISAS, pack_kquant_x86, pack_q5k_x86, pack_q6k_x86, unpack_int4_x86, unpack_q5k_x86,
                       unpack_q6k_x86, x86_kernels)
from .block_linear import BlockLinear
from .gguf_blocks import q4_k_blocks, q5_k_blocks, q6_k_blocks

__all__ = ["KQuantLinear"]

KINDS = ("Q4_K", "Q5_K", "Q6_K")  # the GGUF types this layer runs as they are


class KQuantLinear(BlockLinear):
    """y = x @ W.T + b with W a Q4_K or Q5_K tensor's weights, w = q * (d * sc) + (-dmin) * m per
    group of 32 inputs (q in 0..15, 0..31), or a Q6_K tensor's, w = (d * sc) * q per group of 16
    (q in -32..31), in fp32;
    activations rounded to int8 per group as in every int4 layer here."""

    def __init__(self, qweight: torch.Tensor, kd: torch.Tensor, km: torch.Tensor, bias32: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16, qh: torch.Tensor | None = None):
        super().__init__({"qweight": qweight, "kd": kd, "km": km,
                          "qh": qh if qh is not None else torch.empty(0, dtype=torch.uint8)},
                         bias32, dtype, qweight.shape[1] * 8)
        self.kind = "Q4_K" if qh is None else "Q6_K" if kd.dim() == 3 else "Q5_K"

    @classmethod
    def from_blocks(cls, raw: np.ndarray, bias: torch.Tensor | None = None, rows: np.ndarray | None = None,
                    dtype: torch.dtype = torch.bfloat16, kind: str = "Q4_K") -> "KQuantLinear":
        """The layer of a ``kind`` (Q4_K, Q5_K or Q6_K) tensor's raw bytes (N, K / 256 * block bytes)
        (``GGUFReader``'s ``data``); ``rows``: the order of the output channels (a permutation of
        N, e.g. the inverse of the q/k permutation llama.cpp's converter applies), None for the
        file's own; ``bias`` (N,)."""
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

    def from_parts(self, parts: dict[str, torch.Tensor], bias32: torch.Tensor | None) -> "KQuantLinear":
        return KQuantLinear(parts["qweight"], parts["kd"], parts["km"], bias32, self.dtype,
                            parts["qh"] if self.kind != "Q4_K" else None)

    def _run(self, x2: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        isa = INT4_ISAS[self._isa]
        if self.kind != "Q4_K":
            run = x86_kernels().int4_gemm_q6k if self.kind == "Q6_K" else x86_kernels().int4_gemm_q5k
            return run(x2, self.qweight, self.qh, self.kd, self.km, self.bias32, out_fp32, isa)
        return x86_kernels().int4_gemm_kquant(x2, self.qweight, self.kd, self.km, self.bias32, out_fp32, isa)

    def _run_prefill(self, amx, x2: torch.Tensor) -> torch.Tensor:
        if self.kind == "Q4_K":
            return amx.kquant_prefill_mm(x2, self.qweight, self.kd, self.km, self.bias32, False)
        run = amx.q6k_prefill_mm if self.kind == "Q6_K" else amx.q5k_prefill_mm
        return run(x2, self.qweight, self.qh, self.kd, self.km, self.bias32, False)

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
