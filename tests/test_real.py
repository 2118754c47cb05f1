"""Real pretrained models (installed by `make install`): speculative greedy output is identical
to plain greedy output. float32, as bf16 batched and one-token passes can round apart."""

from __future__ import annotations

import functools

import pytest

from speculant import SpeculativeDecoder, load

pytestmark = pytest.mark.real

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash table is."]


@pytest.fixture(scope="module")
def qwen():
    return load("qwen2.5-coder-1.5b-instruct", "float32"), load("qwen2.5-coder-0.5b-instruct", "float32")


@pytest.fixture(scope="module")
def qwen_plain(qwen):
    """Plain greedy decoding of each prompt by the float32 1.5B target, decoded once per module."""
    @functools.cache
    def plain(prompt: str):
        return SpeculativeDecoder(qwen[0], method="ar", chat=True).generate(prompt, 32)
    return plain


# the float32 1.5B target is the slowest model of make test (a minute per prompt and test): the pair
# decodes the code prompt, the heads the prose one; the int4 runtime's tests take both
@pytest.mark.parametrize("prompt", PROMPTS[:1])
def test_qwen_pair_is_identical_to_plain(qwen, qwen_plain, prompt):
    target, draft = qwen
    plain = qwen_plain(prompt)
    assert len(plain.token_ids) > 8 and plain.text.strip()
    for method, kw in [("sd", {"gamma": 4}), ("mcsd", {"tree": "2x2x1"})]:
        spec = SpeculativeDecoder(target, draft, method=method, chat=True, pacing=False, **kw).generate(prompt, 32)
        assert spec.token_ids == plain.token_ids, method
        assert spec.stats.target_calls < plain.stats.target_calls


@pytest.mark.parametrize("prompt", PROMPTS[1:])
def test_qwen_shipped_heads_medusa_hydra_and_bpd_identical_to_plain(qwen, qwen_plain, prompt):
    """The heads shipped for the 1.5B target (no --heads given) decode losslessly in float32."""
    target, _ = qwen
    plain = qwen_plain(prompt)
    for method in ("medusa", "hydra", "bpd"):
        # a fixed tree: the heads' acceptance, not the cost model's sizing under a busy CPU
        spec = SpeculativeDecoder(target, method=method, chat=True, pacing=False,
                                  tree_budget="fixed").generate(prompt, 32)
        assert spec.token_ids == plain.token_ids, method
        assert spec.stats.target_calls < plain.stats.target_calls, method  # the heads do help
