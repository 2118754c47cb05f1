"""The default runtime on a real model (Qwen2.5-Coder-1.5B, installed by `make install`, on the
native runtime with its GGUF file's own Q4_K and Q6_K blocks): every exact method, alone and
batched, reproduces plain decoding bit for bit. A file of its own, so that `make test`'s two
processes can take the real-model files side by side."""

from __future__ import annotations

import pytest

from speculant import SpeculativeDecoder

from test_real import PROMPTS

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def qwen_default():
    from speculant.api import load_native
    from speculant.defaults import choose_runtime

    rt = choose_runtime("qwen2.5-coder-1.5b-instruct", "bfloat16")
    if rt.backend != "native":
        pytest.skip(f"the default runtime here is not the native one: {rt.why}")
    assert (rt.target_quant, rt.quant_head) == ("gguf", True), rt  # a preset is a GGUF file: its own blocks
    return (load_native("qwen2.5-coder-1.5b-instruct", "bfloat16", rt.target_quant, rt.quant_head),
            load_native("qwen2.5-coder-0.5b-instruct", "bfloat16", "int4"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_runtime_every_method_identical_to_plain(qwen_default, prompt):
    """The default runtime (native, the file's Q4_K/Q6_K blocks, bf16 activations): row-invariant
    passes make every exact method reproduce plain decoding bit for bit, not only in float32."""
    target, draft = qwen_default
    plain = SpeculativeDecoder(target, method="ar", chat=True).generate(prompt, 40)
    from speculant.heads import shipped_heads

    auto = SpeculativeDecoder(target, chat=True)
    eagle = shipped_heads(target.name, "eagle") is not None  # then auto takes whichever the cost model forecasts
    assert auto.method in (("hydra", "eagle") if eagle else ("hydra",)) and auto.lookup_branch and "own blocks" in auto.why
    others = [SpeculativeDecoder(target, method=m, lookup_branch=8, chat=True) for m in ("hydra", "eagle")
              if eagle and m != auto.method]
    for dec in (auto, *others, SpeculativeDecoder(target, method="lookup", chat=True),
                SpeculativeDecoder(target, method="medusa", lookup_branch=4, chat=True),
                SpeculativeDecoder(target, draft, method="mcsd", tree="2x1x1", chat=True, pacing=False)):
        spec = dec.generate(prompt, 40)
        assert spec.token_ids == plain.token_ids, dec.method


def test_default_runtime_batched_is_each_prompt_alone(qwen_default):
    """Several prompts in one batch on the default runtime: each answer is the one it gets alone
    with plain decoding (row-invariant kernels: bit for bit), for the default method and mcsd."""
    target, draft = qwen_default
    plain = SpeculativeDecoder(target, method="ar", chat=True)
    want = [plain.generate(p, 24).token_ids for p in PROMPTS]
    for dec in (SpeculativeDecoder(target, chat=True),
                SpeculativeDecoder(target, draft, method="mcsd", tree="2x1x1", chat=True, pacing=False)):
        assert [r.token_ids for r in dec.generate(list(PROMPTS), 24)] == want, dec.method
