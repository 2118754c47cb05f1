"""Logits -> probabilities, and sampling that never synchronises with the host.

Notation (shared with ``acceptance.py``): p = target distribution, q = draft distribution,
both rows of a ``(B, V)`` tensor over a vocabulary of size V. Everything here is a pure tensor
function: no ``.item()``, no Python branching on tensor values, so a decode step can stay on
the device.

* :func:`logits_to_probs` turns logits into the distribution that speculative decoding must
  reproduce. Draft and target MUST go through the same function with the same
  :class:`~speculant.config.SamplingConfig`; losslessness is defined with respect to the
  filtered target distribution p, and the acceptance rules need q to be exactly the
  distribution the draft tokens were drawn from.
* :func:`sample` draws one token per row with the exponential race
  ``argmax(probs / E)``, ``E ~ Exponential(1)`` i.i.d.: ``E_v / probs_v`` is Exponential with
  rate ``probs_v``, and the smallest of independent exponentials is index v with probability
  ``probs_v / sum(probs)``. Zero-probability tokens get score 0 (forced below every positive
  score), so they are never chosen.
* :func:`sample_candidates` draws k candidates per row, i.i.d. (with replacement) or
  sequentially without replacement; the latter is the top-k of the same race
  (Gumbel-top-k / Plackett-Luce), padded with ``-1`` when q has fewer than k nonzero entries.
* :func:`topk_candidates` is the deterministic counterpart for greedy drafting.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import SamplingConfig

__all__ = [
    "INVALID_TOKEN",
    "logits_to_probs",
    "make_generator",
    "sample",
    "sample_candidates",
    "topk_candidates",
]

#: Marks an invalid candidate (a slot that could not be filled); acceptance rules skip it.
INVALID_TOKEN = -1

# Nucleus filtering compares cumulative sums of float32 probabilities with top_p; a mass that
# is exactly top_p in real arithmetic may come out a few ulps below it. Treating "within
# _TOP_P_TOL of top_p" as reached makes such boundary cases follow the exact-arithmetic rule.
_TOP_P_TOL = 1e-6


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A seeded ``torch.Generator`` on ``device``, or ``None`` (global RNG) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def logits_to_probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """The sampling distribution defined by ``cfg``: ``(..., V)`` logits -> ``(..., V)`` float32.

    Greedy (``cfg.temperature == 0``): the one-hot of ``argmax`` (ties -> lowest index, as
    ``torch.argmax``). Otherwise, in this order:

    1. ``logits.float() / temperature``;
    2. top-k (``cfg.top_k > 0``): keep the tokens whose logit is >= the k-th largest one
       (tokens tied with the k-th are all kept, so the result is independent of tie order);
    3. top-p (``cfg.top_p < 1``): on the distribution left by step 2, keep the smallest set of
       most likely tokens whose cumulative probability reaches ``top_p`` (ties broken towards
       the lower index); the most likely token is always kept;
    4. min_p (``cfg.min_p > 0``): keep the tokens at least ``min_p`` times as likely as the most
       likely one (a ratio that renormalising does not change, so the order of the filters does
       not matter to it);
    5. softmax over the kept tokens (the others get probability exactly 0).

    Penalties (``cfg.penalties``) are not applied here: they depend on the tokens of each node's
    path (``penalties.penalise``, applied to the target's rows before this).
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    if cfg.greedy:
        top = logits.argmax(dim=-1)  # (...)
        return torch.nn.functional.one_hot(top, vocab).to(torch.float32)  # (..., V)

    scores = logits.float() / cfg.temperature  # (..., V)
    if 0 < cfg.top_k < vocab:
        kth = scores.topk(cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        probs = scores.softmax(dim=-1)  # (..., V)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (..., V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V) exclusive cumsum
        keep_sorted = mass_before < cfg.top_p - _TOP_P_TOL
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (..., V)
        scores = scores.masked_fill(~keep, float("-inf"))
    if cfg.min_p > 0:
        floor = scores.max(dim=-1, keepdim=True).values + math.log(cfg.min_p)  # (..., 1)
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return scores.softmax(dim=-1)  # (..., V)


def _race_scores(probs: Tensor, noise: Tensor) -> Tensor:
    """``probs / noise`` with zero-probability entries pinned to -1 (below any real score).

    ``noise`` holds Exponential(1) draws; it is clamped away from 0 so no score is inf/NaN.
    """
    tiny = torch.finfo(noise.dtype).tiny
    scores = probs / noise.clamp_min(tiny)
    return scores.masked_fill(~(probs > 0), -1.0)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from ``probs`` ``(..., V)`` -> LongTensor ``(...)``; no host sync.

    Rows need not be normalised but must have some positive entry (an all-zero row returns 0).
    A zero-probability token is never returned.
    """
    probs = probs.float()
    noise = torch.empty_like(probs).exponential_(generator=generator)  # (..., V)
    return _race_scores(probs, noise).argmax(dim=-1)  # (...)


def sample_candidates(
    q: Tensor, k: int, *, replacement: bool, generator: torch.Generator | None = None
) -> Tensor:
    """k candidate tokens per row drawn from the draft distribution ``q`` ``(B, V)`` -> ``(B, k)``.

    ``replacement=True``: k i.i.d. draws from q (duplicates possible).
    ``replacement=False``: k sequential draws without replacement, i.e. column i is drawn from q
    with columns 0..i-1 removed and renormalised. Computed in one shot as the top-k of the
    exponential race ``q / E``. When a row of q has fewer than k nonzero entries, the surplus
    columns are ``-1`` (:data:`INVALID_TOKEN`).
    """
    if q.dim() != 2:
        raise ValueError(f"q must have shape (B, V), got {tuple(q.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    batch, vocab = q.shape
    q = q.float()
    if replacement:
        noise = torch.empty(batch, k, vocab, device=q.device).exponential_(generator=generator)
        return _race_scores(q.unsqueeze(1), noise).argmax(dim=-1)  # (B, k)

    noise = torch.empty_like(q).exponential_(generator=generator)  # (B, V)
    scores = _race_scores(q, noise)  # (B, V); zero-prob entries are -1
    top_scores, top_tokens = scores.topk(min(k, vocab), dim=-1)  # (B, min(k, V))
    top_tokens = top_tokens.masked_fill(top_scores < 0, INVALID_TOKEN)
    return _pad_invalid(top_tokens, k)  # (B, k)


def topk_candidates(scores: Tensor, k: int) -> Tensor:
    """The k distinct tokens with the largest values of ``scores`` ``(B, V)`` -> ``(B, k)``.

    For greedy drafting: pass logits or probabilities. Ordered by decreasing value, ties broken
    towards the lower index, so column 0 equals ``scores.argmax(-1)``. Padded with ``-1``
    when k > V.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape (B, V), got {tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    order = scores.sort(dim=-1, descending=True, stable=True).indices  # (B, V)
    return _pad_invalid(order[:, :k], k)  # (B, k)


def _pad_invalid(tokens: Tensor, k: int) -> Tensor:
    """Right-pad ``tokens`` ``(B, j)`` with -1 to ``(B, k)``."""
    missing = k - tokens.shape[1]
    if missing <= 0:
        return tokens
    pad = tokens.new_full((tokens.shape[0], missing), INVALID_TOKEN)
    return torch.cat([tokens, pad], dim=1)
