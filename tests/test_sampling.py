"""Unit tests for speculant.sampling: filtering on hand-built logits, sync-free sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from speculant.config import SamplingConfig
from speculant.sampling import (
    INVALID_TOKEN,
    logits_to_probs,
    make_generator,
    sample,
    sample_candidates,
    topk_candidates,
)


def kept(probs: torch.Tensor) -> set[int]:
    """Indices with nonzero probability in a 1-D distribution."""
    return set(torch.nonzero(probs > 0).flatten().tolist())


# Probabilities (at temperature 1) 0.40, 0.25, 0.20, 0.10, 0.05 at indices 3, 0, 4, 1, 2.
BASE = torch.tensor([0.25, 0.10, 0.05, 0.40, 0.20]).log()


# --- logits_to_probs ------------------------------------------------------------------------


def test_greedy_is_one_hot_of_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, -3.0, 0.0, 4.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_greedy_ties_go_to_lowest_index():
    probs = logits_to_probs(torch.tensor([1.0, 5.0, 5.0, 0.0]), SamplingConfig(temperature=0.0))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_ignores_top_k_top_p():
    cfg = SamplingConfig(temperature=0.0, top_k=2, top_p=0.3)
    assert torch.equal(logits_to_probs(BASE, cfg), torch.nn.functional.one_hot(torch.tensor(3), 5).float())


def test_no_filtering_is_softmax_and_float32():
    logits = BASE.to(torch.float64)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor([0.25, 0.10, 0.05, 0.40, 0.20]))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 10.0])
def test_temperature_scales_logits(temperature):
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [(1, {3}), (2, {3, 0}), (3, {3, 0, 4}), (4, {3, 0, 4, 1}), (5, {0, 1, 2, 3, 4}), (9, {0, 1, 2, 3, 4})],
)
def test_top_k_kept_set(top_k, expected):
    probs = logits_to_probs(BASE, SamplingConfig(temperature=1.0, top_k=top_k))
    assert kept(probs) == expected
    # Kept tokens keep their relative weights: renormalised softmax.
    mask = torch.zeros(5, dtype=torch.bool)
    mask[list(expected)] = True
    base = torch.tensor([0.25, 0.10, 0.05, 0.40, 0.20])
    torch.testing.assert_close(probs, torch.where(mask, base, 0.0) / base[mask].sum())


def test_top_k_keeps_ties_with_the_kth():
    probs = logits_to_probs(torch.tensor([1.0, 5.0, 5.0, 0.0]), SamplingConfig(temperature=1.0, top_k=1))
    assert kept(probs) == {1, 2}
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, {3}),  # the top token is always kept
        (0.40, {3}),  # exactly reached by the top token: the smallest set is {3}
        (0.41, {3, 0}),
        (0.65, {3, 0}),  # 0.40 + 0.25 reaches 0.65 exactly
        (0.66, {3, 0, 4}),
        (0.85, {3, 0, 4}),
        (0.90, {3, 0, 4, 1}),
        (0.96, {0, 1, 2, 3, 4}),
        (1.00, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_kept_set(top_p, expected):
    probs = logits_to_probs(BASE, SamplingConfig(temperature=1.0, top_p=top_p))
    assert kept(probs) == expected
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_top_p_applies_after_top_k_and_temperature():
    # top_k=3 leaves {3: .40, 0: .25, 4: .20} -> renormalised .4706, .2941, .2353.
    cfg = SamplingConfig(temperature=1.0, top_k=3, top_p=0.75)
    assert kept(logits_to_probs(BASE, cfg)) == {3, 0}
    cfg = SamplingConfig(temperature=1.0, top_k=3, top_p=0.77)
    assert kept(logits_to_probs(BASE, cfg)) == {3, 0, 4}
    # Temperature 0.5 squares the probabilities then renormalises (sum .275):
    # 3: .5818, 0: .2273, 4: .1455, 1: .0364, 2: .0091 (cumulative .5818, .8091, .9545, ...).
    cfg = SamplingConfig(temperature=0.5, top_p=0.80)
    assert kept(logits_to_probs(BASE, cfg)) == {3, 0}
    cfg = SamplingConfig(temperature=0.5, top_p=0.82)
    assert kept(logits_to_probs(BASE, cfg)) == {3, 0, 4}


def test_filtering_is_batched_and_per_row():
    logits = torch.stack([BASE, BASE.flip(0)]).unsqueeze(0)  # (1, 2, 5)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert probs.shape == (1, 2, 5)
    assert kept(probs[0, 0]) == {3, 0}
    assert kept(probs[0, 1]) == {1, 4}


def test_neg_inf_logits_get_zero_probability():
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.7, top_p=0.99))
    assert kept(probs) == {0, 2}


# --- sample -----------------------------------------------------------------------------------


def test_sample_never_picks_zero_probability_token():
    torch.manual_seed(0)
    probs = torch.rand(20_000, 10)
    probs[probs < 0.5] = 0.0
    probs[:, 7] = 1e-30  # tiny but positive: may be picked
    probs[:, 3] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    tokens = sample(probs, make_generator(1))
    assert tokens.shape == (20_000,) and tokens.dtype == torch.long
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_sample_one_hot_is_deterministic():
    probs = torch.nn.functional.one_hot(torch.tensor([4, 0, 2]), 6).float()
    assert torch.equal(sample(probs, make_generator(3)), torch.tensor([4, 0, 2]))


def test_sample_matches_distribution():
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 100_000
    tokens = sample(p.expand(n, -1), make_generator(7))
    counts = torch.bincount(tokens, minlength=5)
    assert counts[1] == 0
    support = p > 0
    expected = n * p[support].double() / p[support].double().sum()
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 1e-4


def test_sample_is_reproducible_with_seed():
    probs = torch.softmax(torch.randn(64, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = sample(probs, make_generator(123))
    b = sample(probs, make_generator(123))
    c = sample(probs, make_generator(124))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# --- sample_candidates / topk_candidates ---------------------------------------------------


def test_candidates_without_replacement_are_distinct_and_padded():
    q = torch.tensor(
        [
            [0.1, 0.2, 0.3, 0.4, 0.0, 0.0],  # support 4
            [0.0, 0.0, 0.5, 0.0, 0.5, 0.0],  # support 2 < k
            [0.0, 0.0, 0.0, 1.0, 0.0, 0.0],  # point mass
        ]
    ).repeat(500, 1)
    cands = sample_candidates(q, 3, replacement=False, generator=make_generator(0))
    assert cands.shape == (1500, 3) and cands.dtype == torch.long
    row_support = (q > 0).sum(-1)  # (B,)
    for row, support in zip(cands.tolist(), row_support.tolist()):
        valid = [t for t in row if t != INVALID_TOKEN]
        assert len(valid) == min(3, support)
        assert len(set(valid)) == len(valid)
        assert row[len(valid):] == [INVALID_TOKEN] * (3 - len(valid))  # padding at the end
    valid = cands >= 0
    assert (q.gather(1, cands.clamp_min(0))[valid] > 0).all()
    assert torch.equal(cands[2::3], torch.tensor([[3, -1, -1]]).expand(500, -1))


def test_candidates_k_larger_than_vocab_padded():
    q = torch.tensor([[0.5, 0.5]])
    cands = sample_candidates(q, 4, replacement=False, generator=make_generator(0))
    assert sorted(cands[0, :2].tolist()) == [0, 1]
    assert cands[0, 2:].tolist() == [-1, -1]


def test_candidates_with_replacement_are_iid_from_q():
    q = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 50_000
    cands = sample_candidates(q.expand(n, -1), 3, replacement=True, generator=make_generator(5))
    assert cands.shape == (n, 3)
    assert (cands != 1).all()
    for col in range(3):
        counts = torch.bincount(cands[:, col], minlength=4)
        keep = q > 0
        expected = n * q[keep].double() / q[keep].double().sum()
        assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-4
    # Duplicates do occur with replacement.
    assert (cands[:, 0] == cands[:, 1]).any()


def test_candidates_without_replacement_follow_sequential_sampling():
    """Column 1 must be distributed as P(x2=j) = sum_{i != j} q_i q_j / (1 - q_i)."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 100_000
    cands = sample_candidates(q.expand(n, -1), 2, replacement=False, generator=make_generator(11))
    second = torch.zeros(4, dtype=torch.float64)
    for j in range(4):
        second[j] = sum(q[i] * q[j] / (1 - q[i]) for i in range(4) if i != j)
    for col, expected in ((0, q), (1, second)):
        counts = torch.bincount(cands[:, col], minlength=4)
        assert chisquare(counts.numpy(), (n * expected).numpy()).pvalue > 1e-4


def test_sample_candidates_is_reproducible():
    q = torch.softmax(torch.randn(32, 20, generator=torch.Generator().manual_seed(1)), -1)
    for replacement in (True, False):
        a = sample_candidates(q, 4, replacement=replacement, generator=make_generator(9))
        b = sample_candidates(q, 4, replacement=replacement, generator=make_generator(9))
        assert torch.equal(a, b)


def test_topk_candidates_distinct_ordered_and_padded():
    scores = torch.tensor([[0.1, 3.0, 2.0, 3.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    cands = topk_candidates(scores, 3)
    assert torch.equal(cands, torch.tensor([[1, 3, 2], [0, 1, 2]]))
    assert torch.equal(cands[:, 0], scores.argmax(-1))
    assert torch.equal(topk_candidates(scores, 7)[:, 5:], torch.full((2, 2), -1))


def test_make_generator():
    assert make_generator(None) is None
    g = make_generator(42)
    assert isinstance(g, torch.Generator)
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=make_generator(42)))
