"""Weight-only quantization of Linear layers (int8 per channel, int4 per group) for CPU.

Decoding one token is bound by the bytes of weights read, so fewer bytes per weight is speed.
A quantized *draft* costs nothing in output quality: the target verifies every token, so the
output stays exactly the target's; only the acceptance rate can move. Quantizing the target
changes its outputs (a user's choice, measured separately).

Kernels are PyTorch's own CPU weight-only matmuls (``aten._weight_int8pack_mm`` and
``aten._weight_int4pack_mm_for_cpu``); activations stay in the model's dtype. Their cost grows
linearly with the rows of x, while a bf16 matmul on AMX costs about the same for 1 or 16 rows
(measured here, a 896x4864 layer: int4 0.12 ms vs bf16 0.39 ms at 1 row; 0.45 vs 0.43 at 8 rows;
14.4 vs 1.35 at 256 rows). So each layer keeps its dense weight too (memory is not the limit,
bandwidth is) and inputs of more than ``DENSE_ABOVE_ROWS`` rows (prefill, wide tree levels) take
the dense path.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError

QUANT_MODES = ("none", "int8", "int4")
DENSE_ABOVE_ROWS = 4


class _WeightOnly(nn.Module):
    """Shared forward: quantized kernel for few rows, the dense weight for many."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # dense (N, K), shared with the original layer: no copy
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > DENSE_ABOVE_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        y = self._quantized(x2).view(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8Linear(_WeightOnly):
    """y = x @ (q * scale).T + b with q int8 (N, K), one scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()  # (N, K)
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)


class Int4Linear(_WeightOnly):
    """Asymmetric int4 with one (scale, zero) per ``group_size`` input channels:
    w ≈ (q - 8) * scale + zero, q in [0, 15]."""

    def __init__(self, linear: nn.Linear, group_size: int = 64):
        super().__init__(linear)
        n, k = linear.weight.shape
        if k % group_size:
            raise ConfigError(f"int4 needs in_features divisible by {group_size}, got {k}")
        w = linear.weight.detach().float().view(n, k // group_size, group_size)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)  # (N, G, 1)
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
        self.register_buffer("scales_zeros", sz.to(linear.weight.dtype))
        self.group_size = group_size

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_zeros)


def quantize_linears(model: nn.Module, mode: str, group_size: int = 64) -> nn.Module:
    """Replace every nn.Linear of ``model`` (the output layer included) in place; returns model."""
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {mode!r}: choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
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
