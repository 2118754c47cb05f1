r"""Training losses for Medusa heads (pure functions: tensors in, tensors out; no model in sight).

Notation: K heads, B sequences, T positions, V vocabulary. ``tokens[b, t]`` is the token at
position t; the target's hidden state at position t feeds both its own output layer, which
predicts token t+1, and head k (0-based), which predicts token ``t + k + 2`` (see
``speculant.heads``). ``mask[b, j]`` is True iff token j is a training target (a real token, e.g.
one of the target's answer tokens): the pair (position t, head k) counts iff ``t + k + 2 < T`` and
``mask[b, t + k + 2]``. Pad on the right (a masked target never makes an earlier input invalid).

Medusa-1 (frozen backbone):  L = Σ_k λ^k · CE_k, where CE_k is head k's mean cross-entropy over its
counted pairs (λ ≈ 0.8: later heads are less accurate and weigh less).
Medusa-2 (adapted backbone): L = CE_lm + w · L_Medusa-1, CE_lm the backbone's own next-token loss.

``scale`` (K,) (default all 1) multiplies head k's term: a process holding n_k of a global batch's
N_k counted pairs for head k passes ``W · n_k / N_k`` (W processes), so that the mean of the W
processes' losses, which data-parallel training differentiates, is the loss of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["combined_loss", "head_valid_counts", "lm_loss", "medusa_loss", "medusa_loss_rows", "row_targets"]


def _check(tokens: torch.Tensor, mask: torch.Tensor, B: int, T: int) -> None:
    if tokens.shape != (B, T) or mask.shape != (B, T):
        raise ValueError(f"tokens and mask must have shape (B, T) = {(B, T)}, "
                         f"got {tuple(tokens.shape)} and {tuple(mask.shape)}")


def head_valid_counts(mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """mask (B, T) -> (K,) long: how many (position, head k) pairs count for each head."""
    T = mask.shape[1]
    return torch.stack([mask[:, k + 2:].sum() if k + 2 < T else mask.new_zeros((), dtype=torch.long)
                        for k in range(num_heads)]).long()


def medusa_loss(head_logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, lam: float = 0.8,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_k λ^k · CE_k for head logits (K, B, T, V), tokens (B, T) long, mask (B, T) bool.

    Returns ``(loss ()``, ``per_head_loss (K,)``, ``per_head_top1 (K,)``, ``per_head_top5 (K,))``;
    the last three are detached; a head without any counted pair has loss 0 and accuracy 0
    (``head_valid_counts`` tells which). Accuracies are fractions of counted pairs whose true token
    is the head's argmax / among its 5 largest logits.
    """
    if head_logits.dim() != 4:
        raise ValueError(f"head_logits must have shape (K, B, T, V), got {tuple(head_logits.shape)}")
    K, B, T, V = head_logits.shape
    _check(tokens, mask, B, T)
    mask = mask.bool()
    loss = head_logits.new_zeros((), dtype=torch.float32)
    per_loss, top1, top5 = (torch.zeros(K) for _ in range(3))
    for k in range(K):
        s = k + 2  # head k at position t predicts token t + s
        if s >= T:
            continue
        valid = mask[:, s:]  # (B, T-s)
        n = int(valid.sum())
        if n == 0:
            continue
        logits = head_logits[k, :, : T - s][valid].float()  # (n, V)
        target = tokens[:, s:][valid]  # (n,)
        ce = F.cross_entropy(logits, target)
        loss = loss + (lam ** k) * (ce if scale is None else ce * scale[k])
        with torch.no_grad():
            per_loss[k] = ce.detach().cpu()
            top = logits.topk(min(5, V), dim=-1).indices  # (n, 5)
            hit = top == target[:, None]
            top1[k] = hit[:, 0].float().mean().cpu()
            top5[k] = hit.any(dim=-1).float().mean().cpu()
    return loss, per_loss, top1, top5


def lm_loss(lm_logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The backbone's next-token CE: lm_logits (B, T, V), position t predicts token t+1 where
    ``mask[b, t+1]``; a scalar (0 when nothing counts)."""
    if lm_logits.dim() != 3:
        raise ValueError(f"lm_logits must have shape (B, T, V), got {tuple(lm_logits.shape)}")
    B, T, _ = lm_logits.shape
    _check(tokens, mask, B, T)
    valid = mask.bool()[:, 1:]  # (B, T-1)
    if T < 2 or not bool(valid.any()):
        return lm_logits.new_zeros((), dtype=torch.float32)
    return F.cross_entropy(lm_logits[:, :-1][valid].float(), tokens[:, 1:][valid])


def combined_loss(lm_logits: torch.Tensor, head_logits: torch.Tensor, tokens: torch.Tensor,
                  mask: torch.Tensor, lam: float = 0.8, heads_weight: float = 0.2,
                  scale: torch.Tensor | None = None, lm_scale: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa-2: ``CE_lm + heads_weight · medusa_loss``.

    lm_logits (B, T, V), head_logits (K, B, T, V). Returns ``(loss, lm (), heads (),
    per_head_loss (K,), per_head_top1 (K,), per_head_top5 (K,))``, all but ``loss`` detached.
    ``scale`` as in :func:`medusa_loss`, ``lm_scale`` the same for CE_lm's counted positions.
    Under self-distillation the tokens are the original target's greedy output, so CE_lm keeps the
    adapted backbone agreeing with the original one.
    """
    lm = lm_loss(lm_logits, tokens, mask)
    heads, per_loss, top1, top5 = medusa_loss(head_logits, tokens, mask, lam, scale)
    return lm * lm_scale + heads_weight * heads, lm.detach(), heads.detach(), per_loss, top1, top5


def row_targets(tokens: torch.Tensor, mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """tokens (T,), mask (T,) of one sequence -> (T, K) long: head k's target at position t, i.e.
    ``tokens[t + k + 2]`` where that exists and is masked in, else -1."""
    T = tokens.shape[0]
    out = torch.full((T, num_heads), -1, dtype=torch.long)
    for k in range(num_heads):
        s = k + 2
        if s < T:
            out[: T - s, k] = torch.where(mask[s:].bool(), tokens[s:], -1)
    return out


def row_inputs(tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """tokens (T,) of one sequence -> (T, K) long: the tokens ``t + 1 .. t + K`` that sequential
    heads read at position t (``SequentialHeads``: step d reads token t + d), -1 past the end.
    Unlike targets these are not masked: prompt tokens are read even where they are not learnt."""
    T = tokens.shape[0]
    out = torch.full((T, num_heads), -1, dtype=torch.long)
    for d in range(num_heads):
        if d + 1 < T:
            out[: T - d - 1, d] = tokens[d + 1:]
    return out


def medusa_loss_rows(head_logits: torch.Tensor, targets: torch.Tensor, lam: float = 0.8, top5: bool = False,
                     scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_k λ^k · CE_k over independent rows: head_logits (K, n, V), targets (n, K) long (-1 = no target).

    The same loss as :func:`medusa_loss` once each (position, head) pair is a row (heads act
    position by position). Returns ``(loss (), per_head_loss (K,), top1 (K,), top5 (K,), counts (K,))``;
    top5 is computed only with ``top5=True`` (zeros otherwise: it costs a top-k over V).
    """
    K, n, V = head_logits.shape
    if targets.shape != (n, K):
        raise ValueError(f"targets must have shape (n, K) = {(n, K)}, got {tuple(targets.shape)}")
    loss = head_logits.new_zeros((), dtype=torch.float32)
    per_loss, top1, t5, counts = (torch.zeros(K) for _ in range(4))
    for k in range(K):
        valid = targets[:, k] >= 0
        c = int(valid.sum())
        counts[k] = c
        if c == 0:
            continue
        logits, target = head_logits[k][valid], targets[valid, k]  # (c, V), (c,)
        ce = F.cross_entropy(logits.float(), target)
        loss = loss + (lam ** k) * (ce if scale is None else ce * scale[k])
        with torch.no_grad():
            per_loss[k] = ce.detach()
            top1[k] = (logits.argmax(-1) == target).float().mean()
            if top5:
                t5[k] = (logits.topk(min(5, V), dim=-1).indices == target[:, None]).any(-1).float().mean()
    return loss, per_loss, top1, t5, counts
