"""What a linear layer's (or an embedding's) weight stands for, whatever holds it: a dense (N, K)
matrix, or int8 / int4 codes / a GGUF file's blocks standing for one. Code that reads a target's
weights rather than running the layer (heads drafting through its output layer, exports, training,
saving a model) asks this protocol instead of probing attributes.

N = output channels (rows: V for an output layer or an embedding), K = input features (H).

:class:`LinearWeights`  the protocol; the quantized and packed layers of ``runtime`` implement it
                        (``quant.Int8Linear`` / ``Int4Linear``, ``block_linear.BlockLinear`` and its
                        subclasses, ``packing.PackedLinear``)
:class:`DenseWeights`   it for an ``nn.Linear`` or ``nn.Embedding`` (a view of the module's weight)
:func:`weights_of`      the one place that tells them apart
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DenseWeights", "LinearWeights", "weights_of"]


class LinearWeights:
    """The weight of a layer computing ``y = x @ W.T + b``, W (N, K).

    An implementer sets ``in_features`` (K), ``out_features`` (N), ``dtype`` (of the activations it
    takes and returns; a dense layer's: its weight's), ``weight`` (the dense (N, K) weight it holds,
    or None when it holds only a quantized form) and ``bias`` ((N,) added to the dense product, or
    None); a layer without a dense weight implements :meth:`dequantize` (and may implement
    :meth:`dequantize_rows` without de-quantizing all N rows).
    """

    in_features: int
    out_features: int
    dtype: torch.dtype
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def weight_shape(self) -> tuple[int, int]:
        """(N, K)."""
        return self.out_features, self.in_features

    def dense_weight(self) -> torch.Tensor | None:
        """The dense (N, K) weight this layer holds, detached, or None (only a quantized form)."""
        return self.weight.detach() if self.weight is not None else None

    def weight_matrix(self) -> torch.Tensor:
        """The (N, K) floating-point matrix the layer stands for: its dense weight where it holds one,
        else the de-quantized codes (in the dtype :meth:`dequantize` gives)."""
        dense = self.dense_weight()
        return dense if dense is not None else self.dequantize()

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (R,) long of :meth:`weight_matrix`: (R, K) floating point."""
        dense = self.dense_weight()
        return dense[ids] if dense is not None else self.dequantize_rows(ids)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) matrix the quantized form stands for."""
        raise NotImplementedError(f"{type(self).__name__} holds no quantized weight to de-quantize")

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (R,) of :meth:`dequantize`: (R, K)."""
        return self.dequantize()[ids]


class DenseWeights(LinearWeights):
    """:class:`LinearWeights` of an ``nn.Linear`` or ``nn.Embedding``: its (N, K) weight (an
    embedding's (V, H) rows: the tokens' vectors) and bias (an embedding's: None), read when
    asked (so a weight replaced in the module is seen)."""

    def __init__(self, module: nn.Linear | nn.Embedding):
        self.module = module

    in_features = property(lambda self: self.module.weight.shape[1])
    out_features = property(lambda self: self.module.weight.shape[0])
    dtype = property(lambda self: self.module.weight.dtype)
    weight = property(lambda self: self.module.weight)
    bias = property(lambda self: self.module.bias if isinstance(self.module, nn.Linear) else None)


def weights_of(module: nn.Module | None) -> LinearWeights | None:
    """``module`` as :class:`LinearWeights`: itself where it implements them, a
    :class:`DenseWeights` view of an ``nn.Linear`` / ``nn.Embedding``; None for anything else
    (no linear layer: e.g. None, or a module without a (N, K) weight)."""
    if isinstance(module, LinearWeights):
        return module
    if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight is not None and module.weight.dim() == 2:
        return DenseWeights(module)
    return None
