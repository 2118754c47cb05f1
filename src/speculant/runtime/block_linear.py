"""What the linear layers of a GGUF file's own blocks share (``kquant.KQuantLinear`` for Q4_K, Q5_K
and Q6_K, ``block_quant.BlockQuantLinear`` for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0): packed tensors
whose first dimension is the block of 16 output channels, an fp32 bias, and the same interface as
speculant's int4 layers (forward in the activation dtype, forward_float for an output layer's
logits, joined side by side into one kernel call, cut into rows, rows de-quantized on their own).

A subclass says which of its tensors are packed by channel block (:meth:`parts`), how to make a layer
of its kind from such tensors (:meth:`from_parts`), how to run them (:meth:`_run`) and how to
de-quantize them (:meth:`dequantize`); the rest is here.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels import amx_kernels, int4_isa
from .weights import LinearWeights

__all__ = ["BlockLinear"]


class BlockLinear(LinearWeights, nn.Module):
    """The base of the layers that run a GGUF file's blocks as they are (module docstring); their
    weights are read through the :class:`~speculant.runtime.weights.LinearWeights` protocol (no
    dense weight: de-quantized)."""

    kind: str  # the GGUF type, e.g. "Q4_K"

    def __init__(self, parts: dict[str, torch.Tensor], bias32: torch.Tensor | None, dtype: torch.dtype,
                 in_features: int):
        super().__init__()
        self._isa = int4_isa()
        if self._isa is None:
            raise ConfigError("a GGUF file's own blocks run on speculant's x86 kernels, which do not run here "
                              "(not x86, no C++ compiler, or SPECULANT_NO_KERNELS): use target_quant int4")
        for name, t in parts.items():
            self.register_buffer(name, t)
        self._names = tuple(parts)
        self.bias32 = bias32 if bias32 is not None else torch.empty(0)
        self.out_features, self.in_features = next(iter(parts.values())).shape[0] * 16, in_features
        self.dtype = dtype
        self.weight, self.bias = None, None  # no dense weight: the kernels take every width

    def parts(self) -> dict[str, torch.Tensor]:
        """The packed tensors, each (N/16, ...) by block of 16 output channels (empty ones stay empty)."""
        return {name: getattr(self, name) for name in self._names}

    def from_parts(self, parts: dict[str, torch.Tensor], bias32: torch.Tensor | None) -> "BlockLinear":
        """A layer of this one's kind and options made of ``parts``."""
        raise NotImplementedError

    def _run(self, x2: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        """(M, K) in the activation dtype -> (M, N), fp32 or the activation dtype."""
        raise NotImplementedError

    def _run_prefill(self, amx, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) in the activation dtype -> (M, N) in it, through ``amx`` (the AMX module of
        :func:`~speculant.kernels.amx_kernels`): the weights widened to bf16 (``forward_prefill``)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight in float32: the file's own."""
        raise NotImplementedError

    @classmethod
    def concat(cls, layers: "list[BlockLinear]") -> "BlockLinear":
        """One layer computing ``layers`` side by side (e.g. q, k and v: one kernel call, the same
        bits per output); ``layers`` become views of its tensors."""
        first = layers[0]
        if any(type(lin) is not type(first) or lin.in_features != first.in_features or lin.dtype != first.dtype
               or lin.kind != first.kind for lin in layers):
            raise ValueError("concat needs layers of one type, one input size and one dtype")
        bias = (torch.cat([lin.bias32 if lin.bias32.numel() else torch.zeros(lin.out_features) for lin in layers])
                if any(lin.bias32.numel() for lin in layers) else None)
        out = first.from_parts({n: torch.cat([lin.parts()[n] for lin in layers]) for n in first._names}, bias)
        start = 0
        for lin in layers:
            part = out.rows(start, start + lin.out_features)
            for name, t in part.parts().items():
                setattr(lin, name, t)
            lin.bias32 = part.bias32
            start += lin.out_features
        return out

    def rows(self, start: int, stop: int) -> "BlockLinear":
        """Output channels start .. stop-1 (multiples of 16) as a layer sharing this one's tensors."""
        if start % 16 or stop % 16 or not 0 <= start < stop <= self.out_features:
            raise ValueError(f"rows({start}, {stop}): multiples of 16 within {self.out_features}")
        bias = self.bias32[start:stop] if self.bias32.numel() else None
        return self._blocks(slice(start // 16, stop // 16), bias)

    def _blocks(self, blocks, bias: torch.Tensor | None) -> "BlockLinear":
        """The layer of the channel blocks ``blocks`` (a slice or an index tensor) of this one."""
        return self.from_parts({n: t[blocks] if t.numel() else t for n, t in self.parts().items()}, bias)

    def _forward(self, x: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        shape = x.shape
        y = self._run(x.reshape(-1, shape[-1]).to(self.dtype).contiguous(), out_fp32)
        return y.view(*shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N) in the activation dtype
        return self._forward(x, False)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward in float32 (the output layer's logits: no bf16 rounding of the result)."""
        return self._forward(x, True)

    def forward_prefill(self, x: torch.Tensor) -> torch.Tensor:
        """forward for prompt rows (``ForwardRequest.prefill``): on AMX CPUs, where the int4 matmul's
        own path is ``amx``, the file's weights widened to bf16 on AMX tiles
        (``kernels/int4_prefill_amx.cpp``: bf16 activations, not ``forward``'s bits; every row still
        on its own); elsewhere ``forward``."""
        amx = amx_kernels() if self._isa == "amx" else None
        if amx is None:
            return self._forward(x, False)
        shape = x.shape
        y = self._run_prefill(amx, x.reshape(-1, shape[-1]).to(self.dtype).contiguous())
        return y.view(*shape[:-1], self.out_features)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (R,) of the weight, (R, K) in the activation dtype (only their blocks of 16
        are de-quantized: an output layer's draft-vocabulary rows without the whole matrix)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        blocks, inverse = torch.unique(rows // 16, return_inverse=True)
        part = self._blocks(blocks, None).dequantize()
        return part[inverse * 16 + rows % 16].to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} as in the file"
