"""Drafting only while it pays (drafters.pacing.Pacer), lookup chains sized against the pass cost,
and the defaults that pick the runtime and the method (speculant.defaults)."""

from __future__ import annotations

import random

import pytest
import torch

from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend
from speculant.config import SamplingConfig
from speculant.tuning.costmodel import PassCost
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.medusa import MedusaDrafter
from speculant.tuning.pacing import Pacer
from speculant.tuning.sizing import TreeSizer
from speculant.heads import HeadsConfig, MedusaHeads
from speculant.trees.buffers import build_tree, chain

from helpers import decode_to_end
from tiny import fixed_prompts, perturbed, tiny_llama, tiny_model_dir

GREEDY = SamplingConfig()
V = 64


def simulate(pacer: Pacer, draft_tokens, draft_ms: float, plain_ms: float, steps: int = 300) -> int:
    """Drive the pacer with synthetic steps; returns how many steps drafted."""
    rng = random.Random(0)
    drafted = 0
    for _ in range(steps):
        d = pacer.draft_now()
        drafted += d
        pacer.record(d, rng.choice(draft_tokens) if d else 1, draft_ms if d else plain_ms)
    return drafted


def test_pacer_runs_the_faster_arm():
    # drafting yields 1.33 tokens per 50 ms, plain decoding 1 per 30 ms: drafting is hardly run
    assert simulate(Pacer(), [1, 1, 2], 50, 30) < 50
    # drafting yields 2 tokens per 36 ms: plain decoding is only probed
    assert simulate(Pacer(), [1, 2, 3], 36, 30) > 280
    # a close call stays with drafting (the margin)
    assert simulate(Pacer(), [1], 31, 30) > 250


def test_pacer_follows_a_change_of_text():
    p = Pacer()
    assert simulate(p, [1], 60, 30, steps=200) < 30  # drafting loses ...
    simulate(p, [3, 4], 40, 30, steps=p.max_probe_every + 10)  # ... then the text turns copyable:
    assert simulate(p, [3, 4], 40, 30, steps=100) > 95  # within one probe interval, drafting is back


def test_pacer_rejects_bad_settings():
    with pytest.raises(ValueError):
        Pacer(decay=1.0)
    with pytest.raises(ValueError):
        Pacer(probe_every=2, probe_len=2)


class Alternating:
    """A pacer stand-in: drafts on a fixed pattern, whatever the timings (for exactness tests)."""

    def __init__(self, pattern=(True, False, False, True, True, False)):
        self.pattern, self.i = pattern, 0

    def draft_now(self) -> bool:
        return self.pattern[self.i % len(self.pattern)]

    def record(self, drafted: bool, tokens: int, ms: float) -> None:
        assert drafted == self.draft_now()
        self.i += 1


def random_heads(hidden):
    heads = MedusaHeads(HeadsConfig(3, 1, hidden, V, shared_lm_head=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return heads.eval()


@pytest.mark.parametrize("backend_kind", ["hf", "native"])
def test_skipped_drafting_steps_keep_every_drafter_exact(backend_kind):
    """Steps verified without a draft (the drafter not asked to propose, but told the result)
    leave greedy output identical to plain decoding, for drafters that keep state between steps
    (a draft model's cache, heads' hidden state) and for the sized lookup chain."""
    target = tiny_llama(0, scale=4.0)
    make = HFBackend if backend_kind == "hf" else NativeBackend
    flat = PassCost((1, 32), (10.0, 10.5))
    for prompt in fixed_prompts(V)[:3]:
        plain = decode_to_end(make(target), NoDrafter(), prompt).generated
        drafters = [DraftModelDrafter(make(perturbed(target, 0.3)), chain(3), GREEDY, V),
                    DraftModelDrafter(make(perturbed(target, 0.3)), build_tree("2x2"), GREEDY, V),
                    LookupDrafter(4, sizer=TreeSizer(flat)),
                    MedusaDrafter(random_heads(target.config.hidden_size), build_tree("3x2x1"), V, LookupDrafter(3))]
        for drafter in drafters:
            state = decode_to_end(make(target), drafter, prompt, pacer=Alternating())
            assert state.generated == plain, type(drafter).__name__
            assert 0 < state.stats.plain_steps < state.stats.target_calls


def test_lookup_chain_is_sized_by_the_pass_cost():
    """The same copyable text: with rows nearly free the whole chain is verified; where every row
    costs as much as a pass, none of it (and the output is plain decoding's either way)."""
    target = tiny_llama(0, scale=4.0)
    prompt = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12] * 3)
    plain = decode_to_end(HFBackend(target), NoDrafter(), prompt).generated
    rows = {}
    for name, cost in [("flat", PassCost((1, 32), (10.0, 10.3))), ("steep", PassCost((1, 2, 32), (10.0, 20.0, 320.0)))]:
        state = decode_to_end(HFBackend(target), LookupDrafter(6, sizer=TreeSizer(cost)), prompt)
        assert state.generated == plain
        rows[name] = sum(state.stats.drafted_per_call)
    assert rows["steep"] == 0 < rows["flat"]


def test_defaults_pick_the_runtime_and_the_method(tmp_path):
    from speculant import SpeculativeDecoder
    from speculant.defaults import choose_runtime, int4_fits
    from speculant.planning import choose_method
    from speculant.kernels import int4_isa

    d = tiny_model_dir(tmp_path / "m")  # a Llama of hidden size 48: no int4 layout
    assert not int4_fits({"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4})
    assert int4_fits({"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                      "num_key_value_heads": 2})
    rt = choose_runtime(str(d), "bfloat16")
    assert rt.backend == "hf" and rt.target_quant == "none" and "layer sizes" in rt.why
    assert choose_runtime(str(d), "float32").backend == "hf"
    assert choose_runtime(str(d), "float32", backend="native").backend == "native"
    assert choose_method("auto", "qwen2.5-coder-1.5b-instruct", False, 0)[:2] == ("hydra", 8)
    assert choose_method("auto", str(d), True, 0)[0] == "sd"
    assert choose_method("auto", str(d), False, 0)[0] == "lookup"
    assert choose_method("mcsd", str(d), True, 0) == ("mcsd", 0, "")
    dec = SpeculativeDecoder(str(d), dtype="float32")
    assert dec.method == "lookup" and dec.pacing and "lookup" in dec.why
    assert len(dec.generate("w1 w2 w3", 5).token_ids) == 5
    big = tmp_path / "q"  # a Qwen2 whose sizes fit: the native int4 runtime where a kernel runs
    from tiny import tiny_qwen2
    tiny_qwen2(seed=0, hidden=128, dtype=torch.bfloat16).save_pretrained(big)
    rt = choose_runtime(str(big), "bfloat16")
    kernel = int4_isa() is not None
    assert (rt.backend, rt.target_quant, rt.quant_head) == (("native", "int4", True) if kernel else ("hf", "none", False))


def test_a_model_the_native_runtime_cannot_rotate_is_refused_before_loading(tmp_path):
    # partial rotary embeddings (rotating part of each head): refused from config.json alone, with
    # the reason, and the decoder runs on transformers instead
    from speculant.backends.native_arch import native_refusal
    from speculant.defaults import choose_runtime
    from tiny import tiny_qwen2

    fields = {"model_type": "phi3", "hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 256, "vocab_size": 64}
    assert native_refusal(fields) is None
    assert "rotates 16 of 32 dimensions" in native_refusal({**fields, "partial_rotary_factor": 0.5})
    big = tmp_path / "q"
    model = tiny_qwen2(seed=0, hidden=128, dtype=torch.bfloat16)
    model.config.partial_rotary_factor = 0.5
    model.save_pretrained(big)
    rt = choose_runtime(str(big), "bfloat16")
    assert rt.backend == "hf" and "rotates 16 of 32" in rt.why
