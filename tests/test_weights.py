"""The LinearWeights protocol (runtime/weights.py): dense layers and embeddings through the adapter,
quantized layers on their own, the same rows and matrix either way."""

import torch
from torch import nn

from speculant.runtime.quant import Int8Linear
from speculant.runtime.weights import DenseWeights, LinearWeights, weights_of


def _linear(n: int = 48, k: int = 32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


def test_dense_layers_and_embeddings_through_the_adapter():
    lin = _linear()
    w = weights_of(lin)
    assert isinstance(w, DenseWeights) and w.weight_shape == (48, 32) and w.dtype == torch.float32
    assert torch.equal(w.weight_matrix(), lin.weight.detach()) and w.bias is lin.bias
    ids = torch.tensor([5, 0, 47])
    assert torch.equal(w.weight_rows(ids), lin.weight.detach()[ids])
    emb = nn.Embedding(10, 8)
    e = weights_of(emb)
    assert e.weight_shape == (10, 8) and e.bias is None and torch.equal(e.weight_rows(ids[:2]), emb.weight[ids[:2]])
    lin.weight = nn.Parameter(torch.zeros(48, 32))  # read when asked: a replaced weight is seen
    assert w.dense_weight().abs().sum() == 0


def test_anything_else_is_no_linear_layer():
    assert weights_of(None) is None and weights_of(nn.ReLU()) is None


def test_a_quantized_layer_is_its_own_weights_with_or_without_its_dense_copy():
    lin = _linear(bias=False)
    kept, lean = Int8Linear(lin, keep_dense=True), Int8Linear(lin, keep_dense=False)
    assert weights_of(kept) is kept and isinstance(kept, LinearWeights)
    assert kept.weight_shape == lean.weight_shape == (48, 32)
    assert torch.equal(kept.dense_weight(), lin.weight.detach()) and lean.dense_weight() is None
    ids = torch.tensor([3, 40])
    assert torch.equal(lean.weight_rows(ids), lean.dequantize()[ids])
    assert torch.equal(lean.weight_matrix(), lean.dequantize())
    assert (lean.weight_matrix() - lin.weight.detach()).abs().max() < 0.01  # int8 per channel
