"""Sampling end to end: the first two tokens a speculative method emits follow the target's own
joint distribution p(x1) p(x2 | x1), computed exactly from the tiny target model."""

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
from speculant.drafters.recycling import RecycledTable, RecyclingDrafter
from speculant.trees.buffers import build_tree, chain

from tiny import perturbed, tiny_llama

V = 6
N = 3000
SAMPLING = SamplingConfig(temperature=1.0, seed=0)
PROMPT = torch.tensor([1, 2, 3, 1, 2])  # lookup finds "3" after "1 2"


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=4, vocab=V, hidden=16, layers=1, scale=60.0)
    draft = perturbed(target, noise=1.5, seed=5)
    return target, draft


def joint(target) -> torch.Tensor:
    """Exact p(x1, x2 | prompt), flattened (V*V,)."""
    with torch.no_grad():
        p1 = target(PROMPT.view(1, -1)).logits[0, -1].softmax(-1)
        seqs = torch.cat([PROMPT.repeat(V, 1), torch.arange(V).view(V, 1)], dim=1)
        p2 = target(seqs).logits[:, -1].softmax(-1)  # (V, V)
    return (p1[:, None] * p2).flatten()


def emitted(target, make_drafter, replacement=True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    backend = HFBackend(target)
    counts = torch.zeros(V * V)
    for _ in range(N):
        for state, _ in decode(backend, make_drafter(gen), PROMPT, max_new_tokens=2, sampling=SAMPLING,
                               replacement=replacement, generator=gen):
            pass
        x1, x2 = state.generated
        counts[x1 * V + x2] += 1
    return counts


def check(counts, p):
    keep = p > 0
    expected = p[keep] * N
    stat = chisquare(counts[keep].numpy(), expected.numpy() / expected.sum().item() * counts.sum().item())
    tv = 0.5 * (counts / N - p).abs().sum().item()
    return stat.pvalue, tv


CASES = {
    "ar": (lambda t, d: lambda g: NoDrafter(), True),
    "sd-2": (lambda t, d: lambda g: DraftModelDrafter(HFBackend(d), chain(2), SAMPLING, V, generator=g), True),
    "mcsd-3x2-repl": (lambda t, d: lambda g: DraftModelDrafter(HFBackend(d), build_tree("3x2"), SAMPLING, V,
                                                                replacement=True, generator=g), True),
    "mcsd-3x2-norepl": (lambda t, d: lambda g: DraftModelDrafter(HFBackend(d), build_tree("3x2"), SAMPLING, V,
                                                                  replacement=False, generator=g), False),
    "lookup": (lambda t, d: lambda g: LookupDrafter(2), True),
    # the table (shared by every generation, as a decoder's) learns from the passes as they go
    "recycle": (lambda t, d: (lambda table: lambda g: RecyclingDrafter(table, True, gamma=2, nodes=3))(
        RecycledTable(V, 2)), True),
}


@pytest.mark.slow  # N two-token generations per case
@pytest.mark.statistical
@pytest.mark.parametrize("case", list(CASES))
def test_two_token_distribution_matches_target(models, case):
    target, draft = models
    factory, replacement = CASES[case]
    p = joint(target)
    assert p.max() < 0.5  # the test is informative: the target is far from deterministic
    counts = emitted(target, factory(target, draft), replacement)
    pvalue, tv = check(counts, p)
    assert pvalue > 1e-4 and tv < 0.06, (pvalue, tv)


def test_checker_catches_a_wrong_distribution(models):
    target, _ = models
    p = joint(target)
    wrong = p.clone()
    top = int(p.argmax())
    wrong[top] -= 0.03
    wrong[(top + 1) % (V * V)] += 0.03  # a 3-point error in one cell
    counts = torch.distributions.Multinomial(N, probs=wrong).sample()
    pvalue, _ = check(counts, p)
    assert pvalue < 1e-4
