"""Heads drafting a static tree: Medusa's sparse tree (Cai et al. 2024), Hydra's with sequential
heads, and blockwise parallel decoding's chain (BPD, Stern et al. 2018: k heads, top-1 each).

Tree semantics for independent heads (Medusa's static sparse tree): the candidates of one depth
are shared by every parent of that depth, so a node with path ``(r_1, ..., r_d)`` holds the
``r_d``-th ranked token of head ``d-1``: the tree is a subset of the Cartesian product of the
heads' top-k lists.

Sequential heads (``heads.conditioned``, :class:`speculant.heads.SequentialHeads`) also read the
tokens of the path they extend: the tree is then expanded depth by depth, a node's children being
the top-ranked tokens of the heads' step from that node's own state (one projection per depth,
over the nodes of that depth that have children). The same path lists describe both kinds of tree.

How the heads get their state, and the optional lookup branch: ``head_eval``, ``lookup_branch``.
Shapes: H hidden size, N tree nodes (root included), K heads.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..tree import TreeBuffers, chain
from .base import Draft, PassPlan, drive
from .head_eval import HeadsCandidates, HeadsDrafter, HeadsLike
from .lookup import LookupDrafter
from .lookup_branch import LookupBranch

__all__ = ["BlockwiseDrafter", "StaticTreeDrafter"]


class StaticTreeDrafter(HeadsDrafter):
    """Proposes ``tree`` from the heads' top-k lists (greedy, deterministic).

    heads: K heads, ``heads(hidden (H,)) -> (K, V')`` logits (V' >= vocab_size; cut to it).
    tree: compiled static tree; its depth must be <= K, its widest rank < vocab_size.
    vocab_size: the target vocabulary the loop verifies against.
    lookup: optional n-gram drafter whose chain (``lookup.gamma`` nodes) becomes one more branch
    under the root (rank = the heads' tree width); ``self.tree`` is then the combined tree and
    ``self.heads_tree`` the heads' own.
    """

    sizer = None  # a static tree has a fixed size (per-step sizing: dynamic_tree.DynamicTreeDrafter)

    def __init__(self, heads: HeadsLike, tree: TreeBuffers, vocab_size: int, lookup: LookupDrafter | None = None):
        super().__init__(heads, vocab_size)
        self.width = self.evaluator.check_tree(tree)  # top-k taken from every head
        self.tree = self.heads_tree = tree
        self._head_of = (tree.depths[1:] - 1).clamp(min=0)  # (N-1,) head drafting each non-root node
        self._rank_of = tree.ranks[1:]  # (N-1,)
        self.depth = tree.depth  # heads drafting: 0 .. depth-1
        self.lookup = lookup
        self.branch = LookupBranch(tree, lookup) if lookup is not None else None
        if self.branch is not None:
            self.tree = self.branch.tree

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (H,) -> (depth, width) long: the top-``width`` tokens of the first ``depth`` heads."""
        return self.evaluator.candidates(hidden, self.width, self.depth)

    @torch.no_grad()
    def expand(self, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Sequential heads: hidden (H,), root (1,) long -> (N_heads - 1,) long, the tokens of the
        heads' tree below the root, depth by depth (see the module docstring)."""
        tree, heads = self.heads_tree, self.heads
        tokens = torch.empty(tree.size, dtype=torch.long)
        state = heads.step(hidden[None], root.view(1))  # (n_{d-1}, H): states of the previous level
        for d in range(1, tree.depth + 1):
            nodes, start = tree.levels[d], int(tree.levels[d - 1][0])
            parent_rows = tree.parents[nodes] - start  # (n_d,) rows in the previous level, non-decreasing
            need, row = torch.unique_consecutive(parent_rows, return_inverse=True)
            k = int(tree.ranks[nodes].max()) + 1
            top = heads.draft_topk(state[need], k, self.V)  # (|need|, k)
            tokens[nodes] = top[row, tree.ranks[nodes]]
            if d < tree.depth:
                state = heads.step(state[parent_rows], tokens[nodes])
        return tokens[1:]

    def propose(self, context: torch.Tensor) -> Draft:
        return drive(self.propose_passes(context))

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        """``propose`` as a plan of the heads' calls (``drafters.base.PassPlan``): independent
        heads' candidates are one ``HeadsCandidates`` job, which several sequences' drafters run
        together (``batching``); sequential heads expand their tree alone."""
        root = context[-1:]
        if self.hidden is None or self.depth == 0:
            return Draft(chain(0), root.clone())
        self.head_calls += 1
        if self.conditioned:
            heads_tokens = self.expand(self.hidden, root)
        else:
            cands, _ = yield HeadsCandidates(self.evaluator, self.hidden, self.width, self.depth)  # (depth, width)
            heads_tokens = cands[self._head_of, self._rank_of]  # (N_heads - 1,)
        if self.branch is None:
            return Draft(self.tree, torch.cat([root, heads_tokens]))
        return self.branch.draft(context, root, heads_tokens)


class BlockwiseDrafter(StaticTreeDrafter):
    """BPD: a chain of ``gamma`` tokens, head d-1's argmax at depth d (gamma defaults to K)."""

    def __init__(self, heads: HeadsLike, vocab_size: int, gamma: int | None = None):
        K = int(heads.num_heads)
        gamma = K if gamma is None else gamma
        if gamma < 1:
            raise ConfigError(f"blockwise draft length gamma must be >= 1, got {gamma}")
        if gamma > K:
            raise ConfigError(f"blockwise draft length gamma={gamma} needs {gamma} heads, the heads have {K}: "
                              f"use gamma <= {K}")
        super().__init__(heads, chain(gamma), vocab_size)
