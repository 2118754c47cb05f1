r"""Approximate acceptance rules (Medusa typical acceptance, BPD top-k / distance / minimum block):
pure, batched tensor functions, no model in sight. They are NOT lossless — the output may differ
from the target's own greedy or sampled output — and are meant to be off by default.

Shapes: B positions (e.g. the B parent nodes of a tree, or the γ positions of a chain), V
vocabulary, k candidates per position. ``candidates`` ``(B, k)`` long holds the drafted tokens
checked against the target's distribution *at the same position* (the target's output at the
parent node); ``-1`` marks an invalid slot and is never accepted. Every rule returns a bool
``(B, k)`` mask "this candidate is acceptable here"; :func:`accepted_prefix` turns a chain's mask
into its accepted length and :func:`best_path` picks the path of a tree
(``acceptance.walk.accept_tree_approx`` applies a rule to a whole tree).

Rules
-----
* :func:`typical_accept` (Medusa, Cai et al. 2024): accept x if
  ``p(x) > min(ε, δ · exp(−H(p)))``, H the entropy of p (nats). With p from
  ``logits_to_probs`` at temperature 0, p is the one-hot of the argmax, H(p) = 0 and the
  threshold is ``min(ε, δ) < 1`` (ε is checked to be < 1), so exactly the argmax is accepted:
  the rule reduces to greedy matching.
* :func:`topk_accept` (BPD, Stern et al. 2018): accept x if it is among the target's top-k
  tokens (stable descending order, ties to the lower id, so ``k_top = 1`` is greedy exactly).
* :func:`distance_accept` (BPD): accept x if ``‖E[x] − E[argmax p]‖₂ ≤ ε`` for an embedding
  table E ``(V, H)``; ε = 0 accepts the argmax (and exact embedding duplicates).
* :func:`min_block` (BPD minimum block size): force the first m proposals of a chain to be
  accepted whatever the rule says. A BPD block size ℓ (tokens per step, the target's own token
  included) is m = ℓ − 1 here, since every step also emits one target token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError

__all__ = ["accepted_prefix", "best_path", "distance_accept", "entropy", "min_block", "topk_accept", "typical_accept",
           "typical_threshold"]


def _check_candidates(candidates: Tensor, batch: int) -> None:
    if candidates.dim() != 2 or candidates.shape[0] != batch:
        raise ValueError(f"candidates must have shape (B={batch}, k), got {tuple(candidates.shape)}")


def _gather_valid(values: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """values (B, V), candidates (B, k) -> (values at candidates (B, k), valid (B, k) bool)."""
    valid = (candidates >= 0) & (candidates < values.shape[1])
    return values.gather(1, torch.where(valid, candidates, 0)), valid


def entropy(p: Tensor) -> Tensor:
    """H(p) = −Σ p log p in nats, with 0 log 0 = 0: (B, V) -> (B,) float32."""
    p = p.float()
    return -torch.special.xlogy(p, p).sum(dim=-1)


def typical_threshold(p: Tensor, eps: float, delta: float) -> Tensor:
    """``min(ε, δ · exp(−H(p)))`` per row: (B, V) -> (B,)."""
    if not 0 < eps < 1:
        raise ConfigError(f"typical acceptance eps (hard threshold) must be in (0, 1), got {eps}")
    if not delta > 0:
        raise ConfigError(f"typical acceptance delta (entropy-scaled threshold) must be > 0, got {delta}")
    return torch.clamp(delta * torch.exp(-entropy(p)), max=eps)


def typical_accept(p: Tensor, candidates: Tensor, eps: float = 0.09, delta: float = 0.3) -> Tensor:
    """Medusa typical acceptance: ``p(x) > min(ε, δ·exp(−H(p)))``.

    p: ``(B, V)`` target probabilities at temperature T (``logits_to_probs``; a one-hot at T = 0,
    which makes this exactly greedy matching). candidates: ``(B, k)``. Returns bool ``(B, k)``.
    The defaults are Medusa's (posterior threshold 0.09, alpha 0.3).
    """
    if p.dim() != 2:
        raise ValueError(f"p must have shape (B, V), got {tuple(p.shape)}")
    _check_candidates(candidates, p.shape[0])
    threshold = typical_threshold(p, eps, delta)  # (B,)
    p_x, valid = _gather_valid(p.float(), candidates)  # (B, k)
    return valid & (p_x > threshold.unsqueeze(1))


def topk_accept(target_logits: Tensor, candidates: Tensor, k_top: int) -> Tensor:
    """BPD top-k: candidate among the ``k_top`` largest target logits. (B, V), (B, k) -> (B, k) bool.

    Ranks follow a stable descending sort (ties to the lower token id), so ``k_top = 1``
    accepts exactly ``target_logits.argmax(-1)``.
    """
    if k_top < 1:
        raise ConfigError(f"top-k acceptance needs k_top >= 1, got {k_top}")
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must have shape (B, V), got {tuple(target_logits.shape)}")
    _check_candidates(candidates, target_logits.shape[0])
    B, V = target_logits.shape
    order = target_logits.sort(dim=-1, descending=True, stable=True).indices  # (B, V)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(V).expand(B, V))  # (B, V) rank of token
    r_x, valid = _gather_valid(rank, candidates)  # (B, k)
    return valid & (r_x < k_top)


def distance_accept(embedding: Tensor, target_argmax: Tensor, candidates: Tensor, eps: float) -> Tensor:
    """BPD distance: ``‖E[x] − E[argmax]‖₂ ≤ ε``.

    embedding: ``(V, H)`` e.g. the target's input embeddings. target_argmax: ``(B,)`` long.
    candidates: ``(B, k)``. Returns bool ``(B, k)``.
    """
    if not eps >= 0:
        raise ConfigError(f"distance acceptance needs eps >= 0, got {eps}")
    if embedding.dim() != 2:
        raise ValueError(f"embedding must have shape (V, H), got {tuple(embedding.shape)}")
    if target_argmax.dim() != 1:
        raise ValueError(f"target_argmax must have shape (B,), got {tuple(target_argmax.shape)}")
    _check_candidates(candidates, target_argmax.shape[0])
    V = embedding.shape[0]
    valid = (candidates >= 0) & (candidates < V)
    e_x = embedding[torch.where(valid, candidates, 0)].float()  # (B, k, H)
    e_t = embedding[target_argmax].float().unsqueeze(1)  # (B, 1, H)
    dist = (e_x - e_t).norm(dim=-1)  # (B, k)
    return valid & ((dist <= eps) | (candidates == target_argmax.unsqueeze(1)))


def min_block(accepted: Tensor, m: int) -> Tensor:
    """Force the first ``min(m, γ)`` proposals of each chain to be accepted: (B, γ) -> (B, γ) bool.

    ``accepted[b, i]``: the rule's verdict on proposal i of chain b (positions in order).
    """
    if m < 0:
        raise ConfigError(f"minimum block size m must be >= 0, got {m}")
    if accepted.dim() != 2:
        raise ValueError(f"accepted must have shape (B, gamma), got {tuple(accepted.shape)}")
    forced = torch.arange(accepted.shape[1], device=accepted.device) < m  # (γ,)
    return accepted.bool() | forced


def accepted_prefix(accepted: Tensor) -> Tensor:
    """Length of the all-True prefix of each row: (B, γ) bool -> (B,) long."""
    if accepted.dim() != 2:
        raise ValueError(f"accepted must have shape (B, gamma), got {tuple(accepted.shape)}")
    return accepted.long().cumprod(dim=1).sum(dim=1)


def best_path(node_ok: Tensor, retrieve: Tensor, node_logp: Tensor | None = None) -> list[int]:
    """The longest root path of acceptable nodes of a tree (Medusa's choice among candidates).

    node_ok: ``(N,)`` bool, node i acceptable given its parent (the root's entry is ignored).
    retrieve: ``(L, D+1)`` long root-to-leaf paths padded with -1 (``TreeBuffers.retrieve``).
    node_logp: ``(N,)`` optional target log-probability of each node's token; ties between
    equally long paths go to the largest sum of it (Medusa), else to the first leaf.
    Returns node ids, root first (``[0]`` when no depth-1 node is acceptable).
    """
    if node_ok.dim() != 1 or retrieve.dim() != 2:
        raise ValueError(f"node_ok must be (N,) and retrieve (L, D+1), got {tuple(node_ok.shape)}, "
                         f"{tuple(retrieve.shape)}")
    idx = retrieve[:, 1:]  # (L, D) drafted nodes of each root-to-leaf path
    ok = (idx >= 0) & node_ok[idx.clamp(min=0)]  # (L, D)
    length = accepted_prefix(ok)  # (L,)
    best = int(length.max()) if length.numel() else 0
    if best == 0:
        return [0]
    rows = torch.nonzero(length == best).flatten()  # (R,)
    if node_logp is not None and rows.numel() > 1:
        score = node_logp[idx[rows, :best]].sum(dim=1)  # (R,)
        row = int(rows[int(score.argmax())])
    else:
        row = int(rows[0])
    return [0] + idx[row, :best].tolist()
