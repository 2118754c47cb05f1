"""A drafted token tree (:class:`Draft`): what a drafter proposes, what the target verifies and the
acceptance rules walk; and the same tree cut shorter.

Node 0 is the root (the last decided token, not yet in the target's KV cache); every other node is
a drafted token. ``q[i]`` is the distribution the children of node i were drawn from (None for
deterministic proposers such as n-gram lookup, whose proposals are point masses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffers import TreeBuffers, compile_paths

__all__ = ["Draft", "first_nodes", "within_depth"]


@dataclass(frozen=True)
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # (N,) long; tokens[0] = root; -1 marks an invalid (unfilled) node
    q: torch.Tensor | None = None  # (N, V) float32 draft distribution at each node, or None
    predicted: torch.Tensor | None = None  # (N,) bool: nodes the request's prediction proposed (lookup), or None


def within_depth(draft: Draft, depth: int) -> Draft:
    """``draft`` without its nodes deeper than ``depth`` (>= 0)."""
    if draft.tree.depth <= depth:
        return draft
    return first_nodes(draft, int((draft.tree.depths <= depth).sum()))


def first_nodes(draft: Draft, kept: int) -> Draft:
    """``draft``'s first ``kept`` (>= 1) nodes. The nodes are in breadth-first order, so every
    node's parent comes before it: the first M are a tree, and keep their indices (a drafter's
    per-node state stays valid for the cut tree)."""
    if kept >= draft.tree.size:
        return draft
    tree = compile_paths(draft.tree.paths[1:kept])
    return Draft(tree, draft.tokens[:kept], None if draft.q is None else draft.q[:kept],
                 None if draft.predicted is None else draft.predicted[:kept])
