"""Unit tests for speculant.acceptance on hand-built logits and distributions.

p = target distribution, q = draft distribution, candidates (B, k) with -1 = invalid slot.
"""

from __future__ import annotations

import pytest
import torch

from speculant.acceptance import greedy_accept, mcss, residual_distribution, speculative_sampling
from speculant.config import SamplingConfig
from speculant.sampling import logits_to_probs, make_generator, topk_candidates

V = 6
GREEDY = SamplingConfig(temperature=0.0)


def logits_with_argmax(tokens: list[int], vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Random logits (B, V) whose argmax in row b is tokens[b] (by a clear margin)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tokens), vocab, generator=g)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = logits.max() + 3.0
    return logits


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()  # (B, V)


# --- greedy_accept ------------------------------------------------------------------------------


def test_greedy_accept_first_matching_candidate():
    target_logits = logits_with_argmax([2, 4, 0, 5])
    target_token = target_logits.argmax(-1)  # (B,)
    candidates = torch.tensor(
        [
            [1, 2, 2],  # first match at 1 (duplicate later ignored)
            [4, 3, 1],  # match at 0
            [3, 1, 5],  # no match
            [-1, 0, 5],  # invalid slot, then match at 2
        ]
    )
    index = greedy_accept(target_token, candidates)
    assert index.shape == (4,) and index.dtype == torch.long
    assert index.tolist() == [1, 0, -1, 2]


def test_greedy_accept_invalid_never_matches():
    assert greedy_accept(torch.tensor([-1, 3]), torch.tensor([[-1, -1], [-1, -1]])).tolist() == [-1, -1]


def test_greedy_accept_zero_candidates():
    assert greedy_accept(torch.tensor([1, 2]), torch.empty(2, 0, dtype=torch.long)).tolist() == [-1, -1]


def test_greedy_accept_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_token"):
        greedy_accept(torch.tensor([[1]]), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="candidates"):
        greedy_accept(torch.tensor([1, 2]), torch.tensor([[1, 2]]))


# --- mcss / speculative_sampling reduce to greedy on one-hot distributions ----------------------


@pytest.mark.parametrize("replacement", [True, False])
def test_mcss_one_hot_p_and_q_is_greedy(replacement):
    # Every (target token, draft token) pair; candidates are what a drafter would propose from
    # a one-hot q: the draft token repeated (with replacement) or once then -1 (without).
    pairs = [(t, d) for t in range(V) for d in range(V)]
    target = [t for t, _ in pairs]
    draft = [d for _, d in pairs]
    p = logits_to_probs(logits_with_argmax(target, seed=1), GREEDY)  # (B, V) one-hot
    q = logits_to_probs(logits_with_argmax(draft, seed=2), GREEDY)  # (B, V) one-hot
    d = torch.tensor(draft)
    if replacement:
        candidates = torch.stack([d, d, d], dim=1)
    else:
        candidates = torch.stack([d, torch.full_like(d, -1), torch.full_like(d, -1)], dim=1)
    index, residual = mcss(p, q, candidates, replacement=replacement, generator=make_generator(0))
    assert index.shape == (len(pairs),) and residual.shape == (len(pairs), V)
    same = torch.tensor(target) == d
    assert torch.equal(index, torch.where(same, 0, -1))
    assert torch.equal(index, greedy_accept(p.argmax(-1), candidates))
    assert torch.equal(residual[~same], p[~same])  # recovered token = target argmax
    assert torch.equal(residual[~same].argmax(-1), torch.tensor(target)[~same])


def test_speculative_sampling_one_hot_is_greedy():
    p = one_hot([0, 1, 2, 3])
    q = one_hot([0, 2, 2, 5])
    accepted, residual = speculative_sampling(p, q, q.argmax(-1), make_generator(0))
    assert accepted.dtype == torch.bool and accepted.shape == (4,)
    assert accepted.tolist() == [True, False, True, False]
    assert torch.equal(residual[~accepted], p[~accepted])


def test_greedy_drafting_with_topk_candidates_matches_greedy_accept():
    """Greedy multi-candidate drafting: top-k distinct draft tokens, accepted by greedy_accept."""
    target_logits = logits_with_argmax([3, 1, 5])
    draft_logits = logits_with_argmax([3, 4, 2], seed=5)
    draft_logits[1, 1] = draft_logits[1, 4] - 0.1  # target's token is the draft's 2nd choice
    draft_logits[2, 5] = draft_logits[2].min() - 1.0  # target's token is the draft's last choice
    candidates = topk_candidates(draft_logits, 2)  # (B, 2)
    assert candidates[:, 0].tolist() == [3, 4, 2]
    assert greedy_accept(target_logits.argmax(-1), candidates).tolist() == [0, 1, -1]


# --- exact residuals ---------------------------------------------------------------------------

P = torch.tensor([[0.6, 0.0, 0.4, 0.0]])
Q = torch.tensor([[0.1, 0.5, 0.2, 0.2]])


def test_residual_formula_exact():
    p = torch.tensor([[0.5, 0.2, 0.3, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    expected = torch.tensor([[2 / 3, 0.0, 1 / 3, 0.0]])  # max(0, p - q) = [.4, 0, .2, 0]
    torch.testing.assert_close(residual_distribution(p, q), expected)
    # Token 1 has p/q = 1/3; the residual is returned whether or not it was accepted.
    accepted, residual = speculative_sampling(p.expand(1000, -1), q.expand(1000, -1), torch.ones(1000, dtype=torch.long))
    assert 0 < accepted.sum() < 1000
    torch.testing.assert_close(residual, expected.expand(1000, -1))
    # Token 0 has p/q = 5: always accepted.
    accepted, _ = speculative_sampling(p.expand(1000, -1), q.expand(1000, -1), torch.zeros(1000, dtype=torch.long))
    assert accepted.all()


def test_mcss_two_rejections_without_replacement_exact():
    # Candidates 1 then 3 both have p = 0 at their step, so both are rejected for sure.
    # Step 1: p1 = norm(max(0, p - q)) = [5/7, 0, 2/7, 0]; q1 = q without 1 = [.2, 0, .4, .4].
    # Step 2: p2 = norm(max(0, p1 - q1)) = norm([5/7 - .2, 0, 0, 0]) = [1, 0, 0, 0].
    index, residual = mcss(P, Q, torch.tensor([[1, 3]]), replacement=False, generator=make_generator(0))
    assert index.tolist() == [-1]
    torch.testing.assert_close(residual, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_mcss_two_rejections_with_replacement_exact():
    # Step 2 uses the unchanged q: p2 = norm([5/7 - .1, 0, 2/7 - .2, 0]) = [43/49, 0, 6/49, 0].
    index, residual = mcss(P, Q, torch.tensor([[1, 3]]), replacement=True, generator=make_generator(0))
    assert index.tolist() == [-1]
    torch.testing.assert_close(residual, torch.tensor([[43 / 49, 0.0, 6 / 49, 0.0]]))


def test_point_mass_q_residual_is_p_without_the_token():
    p = torch.tensor([[0.1, 0.3, 0.4, 0.2]])
    q = one_hot([2], vocab=4)
    expected = torch.tensor([[1 / 6, 3 / 6, 0.0, 2 / 6]])
    torch.testing.assert_close(residual_distribution(p, q), expected)
    n = 1000
    index, residual = mcss(p.expand(n, -1), q.expand(n, -1), torch.tensor([[2, -1]]).expand(n, -1),
                           replacement=False, generator=make_generator(0))
    rejected = index == -1
    assert 0 < rejected.sum() < n and set(index.tolist()) == {-1, 0}
    torch.testing.assert_close(residual[rejected], expected.expand(int(rejected.sum()), -1))
    accepted, residual = speculative_sampling(p.expand(n, -1), q.expand(n, -1), torch.full((n,), 2))
    torch.testing.assert_close(residual, expected.expand(n, -1))


# --- invalid candidates, edge cases, shapes -------------------------------------------------


@pytest.mark.parametrize("replacement", [True, False])
def test_invalid_candidates_are_skipped(replacement):
    # -1 and a token with q == 0 (token 3 is in p's support) change nothing.
    p = torch.tensor([[0.6, 0.0, 0.1, 0.3]])
    q = torch.tensor([[0.1, 0.5, 0.4, 0.0]])
    index, residual = mcss(p, q, torch.tensor([[-1, 3, 1, -1]]), replacement=replacement)
    _, reference = mcss(p, q, torch.tensor([[1]]), replacement=replacement)
    assert index.tolist() == [-1]
    torch.testing.assert_close(residual, reference)
    # Only invalid candidates: nothing tested, the residual is p itself.
    index, residual = mcss(p, q, torch.tensor([[-1, 3]]), replacement=replacement)
    assert index.tolist() == [-1]
    assert torch.equal(residual, p)
    # A sure acceptance (p/q >= 1) after invalid slots reports its own column.
    index, _ = mcss(p, q, torch.tensor([[-1, 3, 0]]), replacement=replacement)
    assert index.tolist() == [2]


def test_speculative_sampling_token_with_zero_q_is_never_accepted():
    p = torch.tensor([[0.5, 0.5, 0.0]]).expand(100, -1)
    q = torch.tensor([[0.0, 0.5, 0.5]]).expand(100, -1)
    accepted, residual = speculative_sampling(p, q, torch.zeros(100, dtype=torch.long))
    assert not accepted.any()
    assert torch.equal(residual, p)


def test_equal_p_and_q_always_accepts_and_residual_is_finite():
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0]]).expand(1000, -1)
    candidates = torch.tensor([0, 1, 2, 2]).repeat(250).unsqueeze(1)
    accepted, residual = speculative_sampling(p, p.clone(), candidates[:, 0], make_generator(0))
    assert accepted.all()
    assert torch.isfinite(residual).all()
    torch.testing.assert_close(residual.sum(-1), torch.ones(1000))


def test_mcss_zero_candidates():
    p = torch.tensor([[0.2, 0.8]])
    index, residual = mcss(p, torch.tensor([[0.5, 0.5]]), torch.empty(1, 0, dtype=torch.long), replacement=False)
    assert index.tolist() == [-1]
    assert torch.equal(residual, p)


def test_output_shapes_and_dtypes():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(7, V, generator=g), -1)
    q = torch.softmax(torch.randn(7, V, generator=g), -1)
    candidates = torch.randint(0, V, (7, 3), generator=g)
    index, residual = mcss(p, q, candidates, replacement=True, generator=make_generator(1))
    assert index.shape == (7,) and index.dtype == torch.long
    assert residual.shape == (7, V) and residual.dtype == torch.float32
    assert ((index >= -1) & (index < 3)).all()
    torch.testing.assert_close(residual.sum(-1), torch.ones(7))
    accepted, residual = speculative_sampling(p, q, candidates[:, 0], make_generator(1))
    assert accepted.shape == (7,) and accepted.dtype == torch.bool
    assert residual.shape == (7, V) and residual.dtype == torch.float32


def test_bad_shapes_raise():
    p = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="q must have"):
        mcss(p, torch.full((2, 5), 0.2), torch.zeros(2, 1, dtype=torch.long), replacement=True)
    with pytest.raises(ValueError, match="candidates"):
        mcss(p, p, torch.zeros(3, 1, dtype=torch.long), replacement=True)
    with pytest.raises(ValueError, match="p must have"):
        mcss(p[0], p[0], torch.zeros(1, 1, dtype=torch.long), replacement=True)
    with pytest.raises(ValueError, match="token"):
        speculative_sampling(p, p, torch.zeros(2, 1, dtype=torch.long))


def test_deterministic_given_generator():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(500, V, generator=g), -1)
    q = torch.softmax(torch.randn(500, V, generator=g), -1)
    candidates = torch.randint(0, V, (500, 3), generator=g)
    for replacement in (True, False):
        a = mcss(p, q, candidates, replacement=replacement, generator=make_generator(8))
        b = mcss(p, q, candidates, replacement=replacement, generator=make_generator(8))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
