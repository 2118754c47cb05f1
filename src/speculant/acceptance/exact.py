r"""Acceptance rules of speculative decoding: pure, batched tensor functions, no model in sight.

Terms
-----
p
    Target distribution at one position, ``(B, V)``: the target model's logits after
    :func:`speculant.sampling.logits_to_probs`. Speculative decoding is lossless when every
    emitted token is distributed exactly as p.
q
    Draft distribution at the same position, ``(B, V)``, filtered with the same
    ``SamplingConfig``: the distribution the draft candidates were actually drawn from. A
    point mass (one-hot q, e.g. an n-gram lookup proposing a single token) is a valid q.
γ (gamma)
    Draft length: number of draft positions proposed per target call.
k
    Number of candidate tokens proposed at one position (tree width there); a chain has k = 1.
α (alpha)
    Acceptance rate: accepted draft tokens / proposed draft tokens, per position. For the
    k = 1 rule, ``α = Σ_v min(p(v), q(v)) = 1 − TV(p, q)``.
τ (tau)
    Block efficiency: mean number of tokens emitted per target call (≥ 1).
accepted token
    A draft candidate that the rule keeps; the walk then moves on to the next position.
recovered token
    When every candidate at a position is rejected, one token sampled from the *residual*
    distribution returned by the rule; it ends the step.
bonus token
    When the whole drafted path is accepted, one extra token sampled from the target's p at
    the position after the path (not produced here: it is a plain ``sample(p)``).

Rules
-----
* :func:`greedy_accept` — temperature 0: accept the first candidate equal to the target's
  argmax token.
* :func:`speculative_sampling` — Leviathan et al. 2023 / Chen et al. 2023, one candidate x ~ q:
  accept with probability ``min(1, p(x) / q(x))``, otherwise emit a token from
  ``norm(max(0, p − q))``.
* :func:`mcss` — multi-candidate speculative sampling (Yang et al. 2024, "Multi-Candidate
  Speculative Decoding", Algorithm 1 with replacement, Algorithm 2 without replacement).

Why MCSS is exact (induction on the number of candidates left). With none left, the caller
samples from the current p: exact. Otherwise let x ~ q be the next candidate. It is accepted
and emitted with probability ``q(x) · min(1, p(x)/q(x)) = min(p(x), q(x))``; rejection happens
with total probability ``s = Σ_v max(0, q(v) − p(v)) = Σ_v max(0, p(v) − q(v))``. After a
rejection the rule continues with ``p' = norm(max(0, p − q))`` — which does not depend on which
token was rejected — and with the distribution the next candidate is really drawn from: q
again (i.i.d. candidates) or q with x removed and renormalised (sequential sampling without
replacement). By induction the continuation emits p' whatever x was, so the output has
probability ``min(p, q)(v) + s · max(0, p − q)(v) / s = p(v)``. Removing x from q loses nothing
of p': x can only be rejected if ``p(x) < q(x)``, and then ``p'(x) = 0``. Verifying
without-replacement candidates with the with-replacement rule (keeping q) is *not* exact in
general: the acceptance ratio would use q(y) instead of the larger renormalised q(y) / (1 − q(x))
(tests/test_acceptance_stats.py shows the bias). The converse is exact: an i.i.d. candidate
that repeats a rejected x has ``q_i(x) = 0`` and is skipped, and a non-repeat is distributed as
q_i — it merely wastes a slot.

Numerical guards: candidates equal to -1 or with ``q(x) == 0`` (padding; never drawn by a
correct drafter) are skipped without changing p or q. If ``max(0, p − q)`` sums to 0 (p ≤ q
everywhere, i.e. p == q on its support) a rejection has probability 0; p is kept so the
residual stays a valid distribution (no NaN).

All functions are deterministic given ``generator``: each candidate step consumes exactly one
``torch.rand(B)`` draw, whatever the values.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["greedy_accept", "mcss", "residual_distribution", "speculative_sampling"]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_pq(p: Tensor, q: Tensor) -> None:
    _check(p.dim() == 2, f"p must have shape (B, V), got {tuple(p.shape)}")
    _check(q.shape == p.shape, f"q must have the shape of p {tuple(p.shape)}, got {tuple(q.shape)}")


def greedy_accept(target_token: Tensor, candidates: Tensor) -> Tensor:
    """Index of the first candidate equal to the target's token, ``-1`` if none.

    target_token: ``(B,)`` the target's argmax token. candidates: ``(B, k)``; ``-1`` entries
    are invalid and never match. Returns a LongTensor ``(B,)`` with values in ``[-1, k)``.
    """
    _check(target_token.dim() == 1, f"target_token must have shape (B,), got {tuple(target_token.shape)}")
    _check(
        candidates.dim() == 2 and candidates.shape[0] == target_token.shape[0],
        f"candidates must have shape (B={target_token.shape[0]}, k), got {tuple(candidates.shape)}",
    )
    batch, k = candidates.shape
    if k == 0:
        return torch.full((batch,), -1, dtype=torch.long, device=candidates.device)
    match = (candidates == target_token.unsqueeze(1)) & (candidates >= 0)  # (B, k)
    first = match.to(torch.int8).argmax(dim=1)  # (B,) first True (0 when none)
    return torch.where(match.any(dim=1), first, torch.full_like(first, -1))


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p − q))`` row-wise, ``(B, V)``; rows where it sums to 0 return p itself."""
    diff = (p - q).clamp_min(0.0)  # (B, V)
    mass = diff.sum(dim=-1, keepdim=True)  # (B, 1)
    return torch.where(mass > 0, diff / torch.where(mass > 0, mass, 1.0), p)


def mcss(
    p: Tensor,
    q: Tensor,
    candidates: Tensor,
    *,
    replacement: bool,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Multi-candidate speculative sampling at one position.

    Args:
        p: ``(B, V)`` target distribution.
        q: ``(B, V)`` draft distribution the candidates were drawn from.
        candidates: ``(B, k)`` tokens, in the order they were drawn (column 0 first), as from
            :func:`speculant.sampling.sample_candidates` with the same ``replacement``.
            ``-1`` marks an invalid slot.
        replacement: True if candidates are i.i.d. draws from q, False if drawn sequentially
            without replacement.
        generator: RNG for the acceptance coins.

    Returns:
        ``(accepted, residual)``: ``accepted`` LongTensor ``(B,)`` — index of the accepted
        candidate, or ``-1`` if all were rejected; ``residual`` float32 ``(B, V)`` — for rows
        with ``-1``, the distribution to sample the recovered token from; for rows that
        accepted, the p current at acceptance (a valid distribution; do not sample from it).

    For each candidate ``x_i`` in order (rows already accepted are frozen): accept with
    probability ``min(1, p_i(x_i) / q_i(x_i))``; on rejection
    ``p_{i+1} = norm(max(0, p_i − q_i))`` and ``q_{i+1} = q_i`` (with replacement) or
    ``q_i`` with ``x_i`` zeroed and renormalised (without replacement).
    """
    _check_pq(p, q)
    batch, vocab = p.shape
    _check(
        candidates.dim() == 2 and candidates.shape[0] == batch,
        f"candidates must have shape (B={batch}, k), got {tuple(candidates.shape)}",
    )
    p = p.float()
    q = q.float()
    candidates = candidates.long()
    accepted = torch.full((batch,), -1, dtype=torch.long, device=p.device)  # (B,)
    done = torch.zeros(batch, dtype=torch.bool, device=p.device)  # (B,)

    for i in range(candidates.shape[1]):
        x = candidates[:, i]  # (B,)
        in_vocab = (x >= 0) & (x < vocab)
        x_safe = torch.where(in_vocab, x, 0).unsqueeze(1)  # (B, 1)
        p_x = p.gather(1, x_safe).squeeze(1)  # (B,)
        q_x = q.gather(1, x_safe).squeeze(1)  # (B,)
        live = ~done & in_vocab & (q_x > 0)  # (B,) rows that test candidate i
        coin = torch.rand(batch, generator=generator, device=p.device)  # (B,) U[0, 1)
        # u < min(1, p/q)  <=>  u * q < p  (u < 1), without dividing.
        accept = live & (coin * q_x < p_x)
        reject = live & ~accept
        accepted = torch.where(accept, i, accepted)
        done = done | accept

        rej = reject.unsqueeze(1)  # (B, 1)
        p_next = residual_distribution(p, q)  # (B, V)
        if not replacement:
            q_drop = q.scatter(1, x_safe, 0.0)  # (B, V)
            q_mass = q_drop.sum(dim=1, keepdim=True)  # (B, 1); 0 if q was a point mass at x
            q_next = q_drop / torch.where(q_mass > 0, q_mass, 1.0)
            q = torch.where(rej, q_next, q)
        p = torch.where(rej, p_next, p)

    return accepted, p


def speculative_sampling(
    p: Tensor, q: Tensor, token: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Leviathan/Chen rule for one draft token ``token`` ``(B,)`` drawn from ``q`` ``(B, V)``.

    Returns ``(accepted, residual)``: BoolTensor ``(B,)``, accepted with probability
    ``min(1, p(x) / q(x))``; float32 ``(B, V)`` residual ``norm(max(0, p − q))`` to sample the
    recovered token from when not accepted (p itself where that is all-zero, or where the
    token is invalid: -1 or ``q(x) == 0``, which is never accepted). This is :func:`mcss`
    with k = 1.
    """
    _check_pq(p, q)
    _check(token.shape == p.shape[:1], f"token must have shape (B={p.shape[0]},), got {tuple(token.shape)}")
    index, residual = mcss(p, q, token.unsqueeze(1), replacement=True, generator=generator)
    accepted = index == 0  # (B,)
    # Rows that accepted kept p inside mcss; give them the residual too, for uniformity.
    residual = torch.where(accepted.unsqueeze(1), residual_distribution(p.float(), q.float()), residual)
    return accepted, residual
