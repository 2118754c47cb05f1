"""The tree walk: from the target's logits at every node of a drafted tree to the accepted path and
the target's next token.

Shapes: N tree nodes (node 0 the root, the last decided token), V vocabulary. ``target_logits``
``(N, V)``: row i is the target's output after node i, i.e. p at the position of node i's children.
A walk returns ``(path, token)``: the accepted node ids, root first (``[0]`` when nothing is
accepted), and the token the target emits after the path's last node — the *bonus* token when the
path ends at a leaf, the *recovered* token (sampled from the residual) when a node's children were
all rejected. Every step therefore yields ``len(path) - 1`` drafted tokens plus one.

* :func:`accept_tree` — the lossless walk: greedy matching at temperature 0, multi-candidate
  speculative sampling (:func:`~speculant.acceptance.exact.mcss`) otherwise; an approximate
  :class:`~speculant.config.AcceptanceConfig` hands over to :func:`accept_tree_approx`.
* :func:`accept_tree_approx` — an approximate rule of :mod:`~speculant.acceptance.approx` applied
  to every node under its parent's row; the longest acceptable root path wins.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import AcceptanceConfig, SamplingConfig
from ..errors import ConfigError
from ..sampling import logits_to_probs, sample
from ..trees.buffers import TreeBuffers
from ..trees.draft import Draft
from .approx import best_path, distance_accept, topk_accept, typical_accept
from .exact import mcss

__all__ = ["accept_tree", "accept_tree_approx"]


def accept_tree(draft: Draft, target_logits: Tensor, sampling: SamplingConfig, *,
                replacement: bool = True, generator: torch.Generator | None = None,
                acceptance: AcceptanceConfig | None = None, embedding: Tensor | None = None,
                ) -> tuple[list[int], int]:
    """Walk ``draft.tree`` from the root; return the accepted path and the target's next token.
    target_logits: (N, V). ``replacement``: how a draft model's candidates were sampled (with or
    without replacement). ``acceptance``: None / exact = the lossless rules; otherwise
    :func:`accept_tree_approx` (``embedding`` (V, H) for the distance rule)."""
    if acceptance is not None and not acceptance.exact:
        return accept_tree_approx(draft.tree, draft.tokens, target_logits, sampling, acceptance,
                                  embedding=embedding, generator=generator)
    if sampling.greedy:
        return _greedy_walk(draft, target_logits)
    return _sampled_walk(draft, logits_to_probs(target_logits, sampling), replacement, generator)


def _greedy_walk(draft: Draft, target_logits: Tensor) -> tuple[list[int], int]:
    """Temperature 0: a node is accepted when its token is the target's argmax at its parent."""
    # (N,) the target's argmax after each node; max() picks the first maximal index as argmax does.
    # Why max(): docs/design-notes.md#greedy-argmax
    best = target_logits.max(-1).indices.tolist()
    toks, kids = draft.tokens.tolist(), draft.tree.children.tolist()

    def longest(i: int) -> list[int]:  # the longest accepted path from node i (first of equals)
        out = [i]
        for c in kids[i]:
            if c >= 0 and toks[c] == best[i]:
                sub = longest(c)
                if len(sub) + 1 > len(out):
                    out = [i] + sub
        return out

    # Siblings may repeat a token (e.g. a lookup branch beside the heads' candidates): any
    # matching child gives the same output; the deepest match gives it in fewer steps.
    path = longest(0)
    return path, best[path[-1]]


def _sampled_walk(draft: Draft, p: Tensor, replacement: bool,
                  generator: torch.Generator | None) -> tuple[list[int], int]:
    """Temperature > 0: at each node, its children are verified by multi-candidate speculative
    sampling against p (N, V); deterministic proposals (``draft.q is None``) as point masses."""
    children, tokens = draft.tree.children, draft.tokens
    node, path = 0, [0]
    while True:
        kids = children[node]
        kids = kids[kids >= 0]
        if kids.numel() == 0:  # leaf: every drafted token on the path accepted -> bonus token
            return path, int(sample(p[node:node + 1], generator)[0])
        cands = tokens[kids].view(1, -1)  # (1, k)
        if draft.q is None:  # deterministic proposals: point masses tried in rank order (exact)
            i, residual = -1, p[node:node + 1]
            for j in range(cands.shape[1]):
                one = torch.zeros_like(residual).scatter_(1, cands[:, j:j + 1].clamp(min=0), 1.0)
                idx, residual = mcss(residual, one, cands[:, j:j + 1], replacement=True, generator=generator)
                if int(idx[0]) == 0:
                    i = j
                    break
        else:
            idx, residual = mcss(p[node:node + 1], draft.q[node:node + 1], cands,
                                 replacement=replacement, generator=generator)
            i = int(idx[0])
        if i < 0:  # every candidate rejected -> recovered token from the residual
            return path, int(sample(residual, generator)[0])
        node = int(kids[i])
        path.append(node)


def accept_tree_approx(tree: TreeBuffers, tokens: Tensor, target_logits: Tensor, sampling: SamplingConfig,
                       cfg: AcceptanceConfig, *, embedding: Tensor | None = None,
                       generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """An approximate rule on a whole token tree: the accepted path and the target's next token.

    tree: N nodes; tokens ``(N,)`` long (node 0 the root); target_logits ``(N, V)``; cfg: not
    exact; embedding ``(V, H)`` for the distance rule.
    Node i (i > 0) is acceptable when ``cfg.rule`` accepts its token under its parent's row
    (``exact``: the parent's argmax, i.e. greedy matching) or when its depth is <= ``cfg.min_block``.
    The path is the longest root path of acceptable nodes (ties: largest target log-probability,
    as in Medusa). The next token comes from the target's row at the path's end: its argmax at
    temperature 0, and under ``typical`` at every temperature (Medusa: the first token of every
    step's candidates is the target's greedy choice, always accepted; the rule samples only
    through which drafted tokens it accepts), else a sample from the tempered distribution.
    """
    N = tokens.shape[0]
    parents = tree.parents[1:]  # (N-1,)
    cand = tokens[1:].view(-1, 1)  # (N-1, 1) each node's token, checked under its parent's row
    plog = target_logits[parents]  # (N-1, V)
    if cfg.rule == "typical":
        p = logits_to_probs(plog, sampling)
        ok = typical_accept(p, cand, 0.09 if cfg.eps is None else cfg.eps, cfg.delta)
    elif cfg.rule == "topk":
        ok = topk_accept(plog, cand, cfg.k_top)
    elif cfg.rule == "distance":
        if embedding is None:
            raise ConfigError("distance acceptance needs the target's embedding table")
        ok = distance_accept(embedding, plog.argmax(-1), cand, cfg.eps)
    else:
        ok = cand == plog.argmax(-1, keepdim=True)
    node_ok = torch.ones(N, dtype=torch.bool)
    node_ok[1:] = ok[:, 0] | (tree.depths[1:] <= cfg.min_block)
    logp = torch.zeros(N)
    if N > 1:
        logp[1:] = torch.log_softmax(plog.float(), -1).gather(1, cand.clamp(min=0))[:, 0]
    path = best_path(node_ok, tree.retrieve, logp)
    last = target_logits[path[-1]:path[-1] + 1]
    if sampling.greedy or cfg.rule == "typical":
        return path, int(last.argmax(-1)[0])
    token = int(sample(logits_to_probs(last, sampling), generator)[0])
    return path, token
