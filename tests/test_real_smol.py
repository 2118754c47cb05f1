"""A real pretrained model (SmolLM2-135M, installed by `make install`) drafting for itself and with
its shipped heads: speculative greedy output is identical to plain greedy output (float32). A file
of its own, so that `make test`'s two processes can take the real-model files side by side."""

from __future__ import annotations

import pytest

from speculant import SpeculativeDecoder, load

from test_real import PROMPTS

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smol():
    return load("smollm2-135m-instruct", "float32")



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
        # a fixed tree: this checks that the heads are right, not what the cost model makes of a pass
        # cost measured while the other test process holds a core (a tree of the root alone)
        hydra = SpeculativeDecoder(smol, method="hydra", chat=True, lookup_branch=lookup_branch,
                                   pacing=False, tree_budget="fixed").generate(PROMPTS[0], 48)
        assert hydra.token_ids == plain.token_ids
        assert hydra.stats.target_calls < plain.stats.target_calls


def test_smollm2s_q4_1_file_runs_as_it_is_and_speculation_stays_exact():
    """SmolLM2's GGUF is Q4_1 (and a Q8_0 embedding): with target_quant="gguf" every projection runs
    the file's own Q4_1 blocks, and speculative output equals plain output on it."""
    from speculant.runtime.block_quant import BlockQuantLinear
    from speculant.store.gguf_linears import apply_gguf_blocks, source_gguf
    from speculant.store.loading import load_native

    target = load_native("smollm2-135m-instruct", "bfloat16", "int4", True)
    report = apply_gguf_blocks(target.model, source_gguf("smollm2-135m-instruct"))
    assert report["q4_1"] == 7 * len(target.model.blocks) and not report["mismatched"], report
    block = target.model.blocks[0]
    assert block.q_proj.kind == "Q4_1" and isinstance(block.qkv, BlockQuantLinear)
    plain = SpeculativeDecoder(target, method="ar", chat=True).generate(PROMPTS[0], 40)
    for method in ("lookup", "hydra"):
        spec = SpeculativeDecoder(target, method=method, chat=True, pacing=False,
                                  tree_budget="fixed").generate(PROMPTS[0], 40)
        assert spec.token_ids == plain.token_ids, method
    assert spec.stats.target_calls < plain.stats.target_calls  # the heads' tree drafted
    dec = SpeculativeDecoder("smollm2-135m-instruct", method="ar", chat=True, target_quant="gguf")
    assert dec.generate(PROMPTS[0], 40).token_ids == plain.token_ids
