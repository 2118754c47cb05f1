"""The transformers backend's grouped-query attention for masked (tree) passes, and the allocator
setting of the command line."""

import pytest
import torch
import torch.nn.functional as F

from speculant import tune_allocator
from speculant.backends.hf import HFBackend
from speculant.backends.hf_attention import NAME, tree_sdpa_attention
from speculant.trees.buffers import build_tree

from tiny import tiny_qwen2


class _Module(torch.nn.Module):  # what transformers' attention functions read from the layer
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@pytest.mark.parametrize("boolean", [False, True])
def test_function_equals_sdpa_with_repeated_kv_heads(boolean):
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    allowed = torch.rand(1, 1, 5, 12, generator=g) > 0.3
    allowed[..., 0] = True  # every query sees at least one key
    mask = allowed if boolean else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out, weights = tree_sdpa_attention(_Module(3), q, k, v, mask, scaling=0.25)
    ref = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask, scale=0.25)
    assert weights is None and out.shape == (1, 5, 6, 16)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_backend_switches_sdpa_models_and_tree_logits_match_eager(monkeypatch):
    fast, eager = tiny_qwen2(0), tiny_qwen2(0)
    eager.set_attn_implementation("eager")
    assert fast.config._attn_implementation == "sdpa"
    a, b = HFBackend(fast), HFBackend(eager)
    assert fast.config._attn_implementation == NAME
    assert eager.config._attn_implementation == "eager"  # other implementations are left alone
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1))
    tree = build_tree([[0], [1], [0, 0], [0, 1]])
    toks = torch.tensor([ids[12], 3, 9, ids[13], 5])
    for be in (a, b):
        be.forward(ids[:12])
    calls.clear()
    outs = [be.forward(toks, 12 + tree.depths, tree.mask) for be in (a, b)]
    assert calls == [True, True]  # both layers of the sdpa model ran on the 2 KV heads in place
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=1e-5, rtol=1e-5)


def test_tune_allocator_runs():
    assert tune_allocator() in (True, False)
