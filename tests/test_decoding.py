"""End-to-end on tiny random models: speculative output == plain output, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.decoding import decode
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.errors import ConfigError
from speculant.trees.buffers import build_tree, chain

from helpers import decode_to_end
from tiny import perturbed, tiny_llama, fixed_prompts

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, noise=0.3)


def prompts():
    return fixed_prompts(64)


def test_plain_matches_transformers_generate(target):
    target.generation_config.eos_token_id = None  # the config's default EOS (2) would stop HF early
    for prompt in prompts():
        ours = decode_to_end(target, NoDrafter(), prompt, n=30).generated
        ref = target.generate(prompt.view(1, -1), attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
                              generation_config=GenerationConfig(
            max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0))[0, prompt.shape[0]:]
        assert ours == ref.tolist()


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_sd_greedy_identical(target, draft, gamma):
    for prompt in prompts():
        plain = decode_to_end(target, NoDrafter(), prompt)
        spec = decode_to_end(target, DraftModelDrafter(HFBackend(draft), chain(gamma), GREEDY, 64), prompt)
        assert spec.generated == plain.generated
        assert spec.stats.target_calls < plain.stats.target_calls


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["2x2", "3x2x1", "4x2x2x1", "[[0],[1],[0,0],[0,0,0],[2]]"])
@pytest.mark.parametrize("replacement", [True, False])
def test_mcsd_greedy_identical(target, draft, tree, replacement):
    for prompt in prompts():
        plain = decode_to_end(target, NoDrafter(), prompt)
        drafter = DraftModelDrafter(HFBackend(draft), build_tree(tree), GREEDY, 64, replacement=replacement)
        spec = decode_to_end(target, drafter, prompt, replacement=replacement)
        assert spec.generated == plain.generated


@pytest.mark.parametrize("gamma", [2, 8])
def test_lookup_greedy_identical(target, gamma):
    for prompt in prompts():
        plain = decode_to_end(target, NoDrafter(), prompt)
        spec = decode_to_end(target, LookupDrafter(gamma), prompt)
        assert spec.generated == plain.generated


def test_self_draft_accepts_everything(target):
    prompt = prompts()[0]
    spec = decode_to_end(target, DraftModelDrafter(HFBackend(target), chain(4), GREEDY, 64), prompt, n=40)
    assert spec.stats.accepted_per_call == [4] * 8
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.tokens_per_call == 5.0


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_new_tokens_mid_block(target, n):
    prompt = prompts()[0]
    plain = decode_to_end(target, NoDrafter(), prompt, n=n)
    spec = decode_to_end(target, DraftModelDrafter(HFBackend(target), chain(5), GREEDY, 64), prompt, n=n)
    assert len(spec.generated) == n and spec.generated == plain.generated
    assert spec.finish_reason == "length"


@pytest.mark.parametrize("at", [0, 2, 3, 9])
def test_eos_inside_accepted_block(target, at):
    prompt = prompts()[0]
    free = decode_to_end(target, NoDrafter(), prompt, n=20).generated
    eos = free[at]
    expected = free[:free.index(eos) + 1]
    for drafter in (NoDrafter(), DraftModelDrafter(HFBackend(target), chain(5), GREEDY, 64),
                    DraftModelDrafter(HFBackend(target), build_tree("3x2x2"), GREEDY, 64)):
        state = decode_to_end(target, drafter, prompt, n=20, eos={eos})
        assert state.generated == expected
        assert state.finish_reason == "eos"


def test_bad_arguments(target):
    with pytest.raises(ConfigError, match="max_new_tokens"):
        decode_to_end(target, NoDrafter(), torch.tensor([1, 2]), n=0)
    with pytest.raises(ConfigError, match="empty"):
        decode_to_end(target, NoDrafter(), torch.tensor([], dtype=torch.long))
    with pytest.raises(ConfigError, match="context"):
        list(decode(HFBackend(target), NoDrafter(), torch.arange(10), max_new_tokens=4,
                    sampling=GREEDY, max_length=8))


def test_non_finite_logits_are_caught_and_masked_tokens_are_not():
    """NaN, +inf or a row of -inf stop decoding with a clear error; -inf entries (tokens masked
    out) and finite logits whose sum overflows float32 pass."""
    from speculant.decoding import _check_finite
    from speculant.errors import ModelLoadError

    ok = torch.randn(4, 1000)
    ok[1, 7] = float("-inf")
    _check_finite(ok, None, 0)
    huge = torch.full((4, 1000), 3e38)  # finite, but their sum is inf
    _check_finite(huge, None, 0)
    for bad in ("nan", "inf", "row"):
        x = torch.randn(4, 1000)
        if bad == "row":
            x[2] = float("-inf")
        else:
            x[3, 5] = float(bad)
        with pytest.raises(ModelLoadError, match="non-finite logits"):
            _check_finite(x, None, 3)
