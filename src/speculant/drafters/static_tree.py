"""Heads drafting a static tree: Medusa's sparse tree (Cai et al. 2024), Hydra's with sequential
heads, and blockwise parallel decoding's chain (BPD, Stern et al. 2018: k heads, top-1 each).

The tree's tokens come from a ``drafters.proposers.TreeProposer``: independent heads (Medusa's
static sparse tree) share the candidates of one depth between every parent of that depth, so a
node with path ``(r_1, ..., r_d)`` holds the ``r_d``-th ranked token of head ``d-1`` (the tree is a
subset of the Cartesian product of the heads' top-k lists); sequential heads read the tokens of
the path they extend too, a node's children being the top-ranked tokens of the heads' step from
that node's own state. The same path lists describe both kinds of tree.

The optional lookup branch: ``lookup_branch``. Shapes: H hidden size, N tree nodes (root
included), K heads.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..trees.buffers import TreeBuffers, chain
from ..trees.draft import Draft
from .base import HiddenNeed, PassPlan, drive
from .lookup import LookupDrafter
from .lookup_branch import LookupBranch
from .proposers import TreeProposer, check_tree, proposer_for

__all__ = ["BlockwiseDrafter", "StaticTreeDrafter"]


class StaticTreeDrafter:
    """Proposes ``tree`` from a proposer's candidates (greedy, deterministic).

    proposer: a ``drafters.proposers.TreeProposer`` (``proposers.proposer_for(heads, V)``).
    tree: compiled static tree; its depth must be <= the proposer's, its widest rank < vocab_size.
    vocab_size: the target vocabulary the loop verifies against.
    lookup: optional n-gram drafter whose chain (``lookup.gamma`` nodes) becomes one more branch
    under the root (rank = the heads' tree width); ``self.tree`` is then the combined tree and
    ``self.heads_tree`` the heads' own. ``head_calls``: the steps that drafted.
    """

    sizer = None  # a static tree has a fixed size (per-step sizing: dynamic_tree.DynamicTreeDrafter)

    def __init__(self, proposer: TreeProposer, tree: TreeBuffers, vocab_size: int,
                 lookup: LookupDrafter | None = None):
        self.proposer, self.V = proposer, vocab_size
        self.hidden_need: HiddenNeed = proposer.hidden_need
        self.hidden_layers: tuple[int, ...] = proposer.hidden_layers
        self.width = check_tree(proposer, tree, vocab_size)  # top-k taken at every depth
        self.tree = self.heads_tree = tree
        self.depth = tree.depth  # heads drafting: 0 .. depth-1
        self.lookup = lookup
        self.branch = LookupBranch(tree, lookup) if lookup is not None else None
        if self.branch is not None:
            self.tree = self.branch.tree
        self.head_calls = 0
        self._drafted: torch.Tensor | None = None

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """New sequence. ``hidden``: the target's state(s) the proposer asks for (``hidden_need``)."""
        self.proposer.begin(prompt, hidden)
        if self.lookup is not None:
            self.lookup.begin(prompt)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        self.proposer.observe(path, next_token, hidden, self._drafted)
        self._drafted = None

    def propose(self, context: torch.Tensor) -> Draft:
        return drive(self.propose_passes(context))

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        """``propose`` as a plan of the proposer's calls (``drafters.base.PassPlan``), which
        several sequences' drafters run together (``batching``)."""
        root = context[-1:]
        state = self.proposer.state
        if state is None or self.depth == 0:
            draft = Draft(chain(0), root.clone())
        else:
            self.head_calls += 1
            heads_tokens = yield from self.proposer.static(state, root, self.heads_tree)  # (N_heads - 1,)
            draft = Draft(self.tree, torch.cat([root, heads_tokens])) if self.branch is None else \
                self.branch.draft(context, root, heads_tokens)
        self._drafted = draft.tokens
        return draft


class BlockwiseDrafter(StaticTreeDrafter):
    """BPD: a chain of ``gamma`` tokens, head d-1's argmax at depth d (gamma defaults to K)."""

    def __init__(self, heads, vocab_size: int, gamma: int | None = None):
        proposer = proposer_for(heads, vocab_size)
        K = proposer.depth
        gamma = K if gamma is None else gamma
        if gamma < 1:
            raise ConfigError(f"blockwise draft length gamma must be >= 1, got {gamma}")
        if gamma > K:
            raise ConfigError(f"blockwise draft length gamma={gamma} needs {gamma} heads, the heads have {K}: "
                              f"use gamma <= {K}")
        super().__init__(proposer, chain(gamma), vocab_size)
