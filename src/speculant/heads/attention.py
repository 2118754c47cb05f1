"""Attention for the decoding paths of drafter layers (:class:`~speculant.heads.layers.ContextLayer`,
the EAGLE drafter): a few query rows against a cache of keys and values that grows at every step."""

from __future__ import annotations

import torch

__all__ = ["attention_dtype", "grouped_attention"]


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`grouped_attention` computes in for a layer of ``dtype`` (float32 at least),
    hence the one to keep a decoding cache's keys and values in: no conversion at every step."""
    return torch.promote_types(dtype, torch.float32)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of n query rows, each query head reading its key/value head's rows directly (no
    copy of the keys and values per query head): q (Hq, n, D), keys and values (Hkv, L, D), mask
    (n, L) bool (True: attend; every row attends somewhere) -> (Hq, n, D) in q's dtype. Computed
    in float32 at least: PyTorch's bf16 batched matmul on CPU goes through oneDNN, which builds a
    kernel for every new shape, and L grows at every decoding step (1.7 ms a call against 0.04 in
    float32). For the decoding paths: PyTorch's CPU attention with a mask and grouped heads takes
    its reference path, several times slower (docs/design-notes.md#eagle-drafting-cost)."""
    Hq, n, D = q.shape
    Hkv, L = keys.shape[0], keys.shape[1]
    work = attention_dtype(keys.dtype)
    g = Hq // Hkv  # query heads per key/value head, consecutive (head h reads key/value head h // g)
    scores = torch.bmm(q.to(work).reshape(Hkv, g * n, D), keys.to(work).transpose(1, 2)).view(Hkv, g, n, L)
    scores = scores.mul_(D ** -0.5).masked_fill_(~mask, float("-inf"))
    # a sharp softmax (scores spread over hundreds) makes denormal probabilities, and denormals slow
    # every op that touches them on x86 several times over: scores more than 80 below their row's
    # largest count as 80 below (a weight of e^-80 ~ 2e-35 of the largest), the masked ones stay -inf
    shifted = scores.sub_(scores.amax(-1, keepdim=True)).clamp_(min=-80.0).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(shifted, -1).view(Hkv, g * n, L)
    return torch.bmm(p, values.to(work)).view(Hq, n, D).to(q.dtype)
