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
def smol():
    return load("smollm2-135m-instruct", "float32")


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


def test_smollm2_drafting_for_itself_is_identical_to_plain(smol):
    plain = SpeculativeDecoder(smol, method="ar", chat=True).generate(PROMPTS[0], 48)
    for method, kw in [("sd", {"gamma": 4}), ("mcsd", {"tree": "2x2x1"})]:
        # pacing off: this checks acceptance (a self-draft never pays in time; the pacer would stop it)
        spec = SpeculativeDecoder(smol, smol, method=method, chat=True, pacing=False, **kw).generate(PROMPTS[0], 48)
        assert spec.token_ids == plain.token_ids, method
        assert spec.stats.tokens_per_call > 2  # a self-draft is (nearly) always accepted
    lookup = SpeculativeDecoder(smol, method="lookup", chat=True).generate(PROMPTS[0], 48)
    assert lookup.token_ids == plain.token_ids
    for lookup_branch in (0, 4):  # the sequential heads shipped for SmolLM2
        hydra = SpeculativeDecoder(smol, method="hydra", chat=True, lookup_branch=lookup_branch,
                                   pacing=False).generate(PROMPTS[0], 48)
        assert hydra.token_ids == plain.token_ids
        assert hydra.stats.target_calls < plain.stats.target_calls


@pytest.mark.parametrize("prompt", PROMPTS)
def test_qwen_pair_is_identical_to_plain(qwen, qwen_plain, prompt):
    target, draft = qwen
    plain = qwen_plain(prompt)
    assert len(plain.token_ids) > 8 and plain.text.strip()
    for method, kw in [("sd", {"gamma": 4}), ("mcsd", {"tree": "2x2x1"})]:
        spec = SpeculativeDecoder(target, draft, method=method, chat=True, pacing=False, **kw).generate(prompt, 32)
        assert spec.token_ids == plain.token_ids, method
        assert spec.stats.target_calls < plain.stats.target_calls


@pytest.mark.parametrize("prompt", PROMPTS)
def test_qwen_shipped_heads_medusa_hydra_and_bpd_identical_to_plain(qwen, qwen_plain, prompt):
    """The heads shipped for the 1.5B target (no --heads given) decode losslessly in float32."""
    target, _ = qwen
    plain = qwen_plain(prompt)
    for method in ("medusa", "hydra", "bpd"):
        spec = SpeculativeDecoder(target, method=method, chat=True, pacing=False).generate(prompt, 32)
        assert spec.token_ids == plain.token_ids, method
        assert spec.stats.target_calls < plain.stats.target_calls, method  # the heads do help


@pytest.fixture(scope="module")
def qwen_int4():
    from speculant.api import load_native
    from speculant.defaults import choose_runtime

    rt = choose_runtime("qwen2.5-coder-1.5b-instruct", "bfloat16")
    if rt.backend != "native":
        pytest.skip(f"the default runtime here is not the native int4 one: {rt.why}")
    return (load_native("qwen2.5-coder-1.5b-instruct", "bfloat16", rt.target_quant, rt.quant_head),
            load_native("qwen2.5-coder-0.5b-instruct", "bfloat16", "int4"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_int4_runtime_every_method_identical_to_plain(qwen_int4, prompt):
    """The default runtime (native, int4 weights, bf16 activations): row-invariant passes make
    every exact method reproduce plain decoding bit for bit, not only in float32."""
    target, draft = qwen_int4
    plain = SpeculativeDecoder(target, method="ar", chat=True).generate(prompt, 40)
    from speculant.heads import shipped_heads

    auto = SpeculativeDecoder(target, chat=True)
    eagle = shipped_heads(target.name, "eagle") is not None  # then auto takes whichever the cost model forecasts
    assert auto.method in (("hydra", "eagle") if eagle else ("hydra",)) and auto.lookup_branch and "int4" in auto.why
    others = [SpeculativeDecoder(target, method=m, lookup_branch=8, chat=True) for m in ("hydra", "eagle")
              if eagle and m != auto.method]
    for dec in (auto, *others, SpeculativeDecoder(target, method="lookup", chat=True),
                SpeculativeDecoder(target, method="medusa", lookup_branch=4, chat=True),
                SpeculativeDecoder(target, draft, method="mcsd", tree="2x1x1", chat=True, pacing=False)):
        spec = dec.generate(prompt, 40)
        assert spec.token_ids == plain.token_ids, dec.method


def test_default_int4_runtime_batched_is_each_prompt_alone(qwen_int4):
    """Several prompts in one batch on the default runtime: each answer is the one it gets alone
    with plain decoding (row-invariant kernels: bit for bit), for the default method and mcsd."""
    target, draft = qwen_int4
    plain = SpeculativeDecoder(target, method="ar", chat=True)
    want = [plain.generate(p, 24).token_ids for p in PROMPTS]
    for dec in (SpeculativeDecoder(target, chat=True),
                SpeculativeDecoder(target, draft, method="mcsd", tree="2x1x1", chat=True, pacing=False)):
        assert [r.token_ids for r in dec.generate(list(PROMPTS), 24)] == want, dec.method
