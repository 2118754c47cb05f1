"""Penalties, logit bias, min_p and logprobs under speculation: every verified node's row is the
row a one-token step gives once its path is committed (bit for bit), greedy speculative output with
penalties equals plain decoding with them, sampled output follows the penalised target
distribution (with a negative control), and the reported log-probabilities are plain decoding's."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.decoding import decode
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.errors import ConfigError
from speculant.penalties import Penalties, penalise
from speculant.sampling import logits_to_probs
from speculant.trees.buffers import build_tree, chain

from tiny import fixed_prompts, perturbed, tiny_llama

PEN = Penalties(presence=0.7, frequency=0.9, repetition=1.4, logit_bias=((3, 1.5), (5, -2.0)))


def naive_row(logits: torch.Tensor, context: list[int], prompt_len: int, p: Penalties) -> torch.Tensor:
    """The penalised row after ``context``, token by token (the module doc's rule, written out)."""
    out = logits.float().clone()
    generated = context[prompt_len:]
    bias = dict(p.logit_bias)
    for t in range(out.shape[0]):
        x = out[t]
        if t in context and p.repetition != 1.0:
            x = x / p.repetition if x > 0 else x * p.repetition
        c = generated.count(t)
        x = x - p.frequency * c - p.presence * (c > 0) + bias.get(t, 0.0)
        out[t] = x
    return out


def test_each_nodes_row_is_penalised_for_its_own_path():
    g = torch.Generator().manual_seed(0)
    V = 12
    tree = build_tree("3x2x1")
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    tokens[1], tokens[4] = 7, 7  # a token drafted twice along one path, and one in the context
    context = torch.tensor([1, 2, 7, 3, 3, 9])
    logits = torch.randn(tree.size, V, generator=g) * 3
    got = penalise(logits, PEN, context, 3, tree, tokens)
    for i in range(tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(tree.parents[j])
        want = naive_row(logits[i], context.tolist() + path[::-1], 3, PEN)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    # bit for bit what a one-token step computes once the path is committed
    i = int(tree.levels[3][0])
    path, j = [], i
    while j > 0:
        path.append(int(tokens[j]))
        j = int(tree.parents[j])
    committed = torch.cat([context, torch.tensor(path[::-1])])
    alone = penalise(logits[i:i + 1], PEN, committed, 3, chain(0), committed[-1:])
    assert torch.equal(got[i], alone[0])


def test_penalties_are_checked():
    for bad in (dict(presence=2.5), dict(frequency=-3.0), dict(repetition=0.0), dict(logit_bias=((1, 101.0),)),
                dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(ConfigError):
            Penalties(**bad)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        Penalties(logit_bias=((99, 1.0),)).check_vocab(10)
    with pytest.raises(ConfigError, match="min_p"):
        SamplingConfig(temperature=1.0, min_p=1.0)


def test_min_p_keeps_the_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, min_p=0.2))
    assert (p[0, :3] > 0).all() and p[0, 3] == 0  # 0.08 < 0.2 x 0.5
    torch.testing.assert_close(p[0, :3], torch.tensor([0.5, 0.3, 0.12]) / 0.92)


V = 32


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, vocab=V, hidden=32, scale=4.0)
    return target, perturbed(target, noise=0.3, seed=1)


def _run(backend, drafter, prompt, sampling, n=24, logprobs=None):
    for state, _ in decode(backend, drafter, prompt, max_new_tokens=n, sampling=sampling, logprobs=logprobs):
        pass
    return state


def test_greedy_with_penalties_is_plain_decoding_with_them(pair):
    target, draft = pair
    backend = HFBackend(target)
    greedy = SamplingConfig(penalties=PEN)
    changed = 0
    for prompt in fixed_prompts(V):
        plain = _run(backend, NoDrafter(), prompt, greedy).generated
        changed += plain != _run(backend, NoDrafter(), prompt, SamplingConfig()).generated
        for drafter in (LookupDrafter(3), DraftModelDrafter(HFBackend(draft), build_tree("2x2x1"), greedy, V)):
            assert _run(backend, drafter, prompt, greedy).generated == plain
    assert changed  # the penalties change what is generated: the equality above says something


def test_logprobs_are_plain_decodings(pair):
    target, draft = pair
    backend = HFBackend(target)
    for prompt in fixed_prompts(V)[:2]:
        steps = []
        for _, step in decode(backend, NoDrafter(), prompt, max_new_tokens=16, sampling=SamplingConfig(), logprobs=3):
            steps.append(step)
        plain = [lp for s in steps for lp in s.logprobs]
        spec = []
        drafter = DraftModelDrafter(HFBackend(draft), build_tree("2x2x1"), SamplingConfig(), V)
        for _, step in decode(backend, drafter, prompt, max_new_tokens=16, sampling=SamplingConfig(), logprobs=3):
            assert len(step.logprobs) == len(step.tokens)
            spec += step.logprobs
        assert len(spec) == len(plain) == 16
        for a, b in zip(spec, plain):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(a.top[0][1], abs=1e-6)  # greedy: the chosen token is the top one


# ---- sampling: the penalised target distribution ---------------------------------------------
Vs = 6
N = 3000
PROMPT = torch.tensor([1, 2, 3, 1, 2])
SPEN = Penalties(presence=0.8, frequency=0.6, repetition=1.5, logit_bias=((0, 1.2),))


def _joint(target, p: Penalties) -> torch.Tensor:
    """Exact p(x1, x2 | prompt) under the penalties, flattened (V*V,)."""
    with torch.no_grad():
        l1 = target(PROMPT.view(1, -1)).logits[0, -1]
        p1 = naive_row(l1, PROMPT.tolist(), len(PROMPT), p).softmax(-1)
        rows = []
        for x1 in range(Vs):
            seq = torch.cat([PROMPT, torch.tensor([x1])])
            l2 = target(seq.view(1, -1)).logits[0, -1]
            rows.append(naive_row(l2, seq.tolist(), len(PROMPT), p).softmax(-1))
    return (p1[:, None] * torch.stack(rows)).flatten()


def _counts(target, make_drafter, sampling) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    backend = HFBackend(target)
    counts = torch.zeros(Vs * Vs)
    for _ in range(N):
        state = None
        for state, _ in decode(backend, make_drafter(gen), PROMPT, max_new_tokens=2, sampling=sampling, generator=gen):
            pass
        x1, x2 = state.generated
        counts[x1 * Vs + x2] += 1
    return counts


def _pvalue(counts, p):
    keep = p > 0
    expected = p[keep] / p[keep].sum() * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def _penalised_pair():
    target = tiny_llama(seed=4, vocab=Vs, hidden=16, layers=1, scale=60.0)
    return target, perturbed(target, noise=1.5, seed=5)


SPEN_SAMPLING = SamplingConfig(temperature=1.0, seed=0, penalties=SPEN)
PENALISED_DRAFTERS = {  # drafter factories by name: (draft model, generator) -> drafter
    "mcsd-3x2": lambda draft, sampling: lambda g: DraftModelDrafter(HFBackend(draft), build_tree("3x2"), sampling,
                                                                    Vs, generator=g),
    "lookup": lambda draft, sampling: lambda g: LookupDrafter(2),
}


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("drafter", list(PENALISED_DRAFTERS))
def test_sampling_with_penalties_follows_the_penalised_target(drafter):
    target, draft = _penalised_pair()
    p = _joint(target, SPEN)
    plain = _joint(target, Penalties())
    assert 0.5 * (p - plain).abs().sum() > 0.1  # the penalties move the distribution a lot
    counts = _counts(target, PENALISED_DRAFTERS[drafter](draft, SPEN_SAMPLING), SPEN_SAMPLING)
    assert _pvalue(counts, p) > 1e-4


@pytest.mark.slow
@pytest.mark.statistical
def test_penalised_sampling_check_catches_the_unpenalised_target():
    """Negative control of the test above: the same drafts verified against the unpenalised
    target fail the check against the penalised distribution."""
    target, draft = _penalised_pair()
    unpenalised = SamplingConfig(temperature=1.0, seed=0)
    wrong = _counts(target, PENALISED_DRAFTERS["mcsd-3x2"](draft, unpenalised), unpenalised)
    assert _pvalue(wrong, _joint(target, SPEN)) < 1e-4
