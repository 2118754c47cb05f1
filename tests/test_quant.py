"""Weight-only quantization: numerics of the layers, and a quantized draft keeps output exact."""

import pytest
import torch
from torch import nn

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.errors import ConfigError
from speculant.runtime.quant import Int4Linear, Int8Linear, quantize_linears
from speculant.trees.buffers import build_tree, chain

from helpers import decode_to_end
from tiny import perturbed, tiny_llama


@pytest.mark.parametrize("cls, tol", [(Int8Linear, 0.02), (Int4Linear, 0.12)])
def test_quantized_linear_is_close_and_dense_path_exact(cls, tol):
    torch.manual_seed(0)
    lin = nn.Linear(128, 48, bias=True).to(torch.bfloat16)
    q = cls(lin)
    few = torch.randn(2, min(q.dense_above_rows // 2, 8), 128, dtype=torch.bfloat16)  # quantized kernel
    ref = lin(few).float()
    rel = ((q(few).float() - ref).norm() / ref.norm()).item()
    assert 0 < rel < tol
    if getattr(q, "kind", None) == "x86":  # speculant's x86 kernel is used at every width
        assert q.dense_above_rows > 1 << 20
        return
    many = torch.randn(q.dense_above_rows + 1, 128, dtype=torch.bfloat16)  # dense path
    assert torch.equal(q(many), lin(many))


def test_quantize_linears_replaces_every_linear_and_rejects_bad_modes():
    model = tiny_llama(0, hidden=64).to(torch.bfloat16)
    quantize_linears(model, "int4")
    assert not any(type(m) is nn.Linear for m in model.modules())
    with pytest.raises(ConfigError, match="unknown quantization"):
        quantize_linears(model, "int3")
    with pytest.raises(ConfigError, match="bfloat16"):
        quantize_linears(tiny_llama(0, hidden=64), "int4")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_draft_keeps_greedy_output_identical(mode):
    target = tiny_llama(0, hidden=64, scale=4.0)
    draft = quantize_linears(perturbed(target, 0.2).to(torch.bfloat16), mode)
    greedy = SamplingConfig()
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(0))

    plain = decode_to_end(target, NoDrafter(), prompt, n=30)
    for tree in (chain(4), build_tree("2x2x1")):
        spec = decode_to_end(target, DraftModelDrafter(HFBackend(draft), tree, greedy, 64), prompt, n=30)
        assert spec.generated == plain.generated
        assert sum(spec.stats.accepted_per_call) > 0


def test_concat_joins_layers_with_biases_into_one_call_of_the_same_bits():
    """q/k/v (Qwen2 has their biases) joined into one int4 layer: each part's output equals the
    layer alone, and the parts become views of the joined buffers, float32 bias included (a freshly
    quantized nn.Linear's bf16 bias Parameter is dropped, not kept as a second copy)."""
    torch.manual_seed(0)
    linears = [nn.Linear(128, n, bias=True).to(torch.bfloat16) for n in (64, 32, 32)]
    layers = [Int4Linear(l, keep_dense=False) for l in linears]
    if layers[0].kind == "torch":
        pytest.skip("speculant's int4 kernel does not run here (PyTorch's int4 layout cannot be joined)")
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    alone = [l(x) for l in layers]
    joined = Int4Linear.concat(layers)
    parts = joined(x).split([64, 32, 32], dim=-1)
    for a, p, l in zip(alone, parts, layers):
        assert torch.equal(a, p)
        assert torch.equal(l(x), a)  # the layer itself, now a view of the joined weights
        assert l.qweight.data_ptr() >= joined.qweight.data_ptr()
        assert l.bias32.data_ptr() >= joined.bias32.data_ptr() and l.bias is None
