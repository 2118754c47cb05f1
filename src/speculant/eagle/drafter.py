"""The EAGLE drafter in the decoding loop (method ``eagle``): EAGLE-2's dynamic tree (the beam of
``drafters.dynamic_tree``, sized per step by the cost model) grown by :class:`EagleModel`.

State kept per sequence: an :class:`EagleCache` of the committed pairs (h_i, x_{i+1}) and the
feature f of the next root (what the drafter predicts the target's hidden state there to be).
Each step:

- ``propose``: the root's children are the top-k of lm_head(f); every expanded node runs one
  :meth:`EagleModel.tree_step` (its parent's feature and its own token, attending to the committed
  pairs and to its ancestors' keys, staged in the cache for this step only), whose feature ranks its children.
- ``observe``: the target's hidden states of the accepted path (``HiddenNeed.ALL``) and the
  tokens after each node (the path's next node, then the target's own next token) are committed
  as pairs; the last pair's feature is the next root's.

Proposals are deterministic (``Draft.q`` is None): the target verifies every token, so the
output is plain decoding's. Shapes: H hidden size, k children per expanded node, b nodes expanded
at a depth, E nodes expanded so far in this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..backends.base import HiddenNeed
from ..drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
from ..drafters.proposers import Stepwise
from ..drafters.lookup import LookupDrafter
from ..tuning.sizing import TreeSizer
from .model import EagleCache, EagleModel

__all__ = ["EagleDrafter", "EagleSteps"]


@dataclass(eq=False)
class _TreeSight:
    """Which of this step's expanded nodes (staged in the cache in this order) each one sees."""
    sees: torch.Tensor | None = None  # (E, E) bool: row j = node j's ancestors and itself

    def rows(self, slots: list[int]) -> torch.Tensor | None:
        """What new children of the expanded nodes ``slots`` (-1: the root) see: (b, E) bool."""
        if self.sees is None:
            return None
        E = self.sees.shape[0]
        out = torch.zeros(len(slots), E, dtype=torch.bool)
        for i, s in enumerate(slots):
            if s >= 0:
                out[i] = self.sees[s]
        return out

    def add(self, b: int, sees: torch.Tensor | None) -> list[int]:
        """Append b expanded nodes (``sees`` (b, E) or None); their slots."""
        E = 0 if self.sees is None else self.sees.shape[0]
        grown = torch.zeros(E + b, E + b, dtype=torch.bool)
        if self.sees is not None:
            grown[:E, :E] = self.sees
        if sees is not None:
            grown[E:, :E] = sees
        grown[E:, E:] = torch.eye(b, dtype=torch.bool)
        self.sees = grown
        return list(range(E, E + b))


@dataclass(frozen=True, eq=False)
class EagleRootStep:
    """The root's children: (the root's feature (1, H), tokens (1, k), log p (1, k))."""
    source: "EagleSteps"
    feature: torch.Tensor  # (H,)
    k: int

    @property
    def together(self) -> Hashable:
        return ("eagle-root", id(self.source.model), self.k, self.source.V)

    @staticmethod
    @torch.no_grad()
    def run_together(jobs: Sequence["EagleRootStep"]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        states = torch.stack([j.feature for j in jobs])  # (B, H)
        tok, logp = jobs[0].source.children(states, 1, jobs[0].k)
        return [(states[i:i + 1], tok[i:i + 1], logp[i:i + 1]) for i in range(len(jobs))]


@dataclass(frozen=True, eq=False)
class EagleExpandStep:
    """b nodes of one sequence's tree at ``depth``: their features (b, H), their children's
    tokens (b, k) and log p (b, k). Each sequence attends over its own cache, so several
    sequences' steps run one after the other."""
    source: "EagleSteps"
    front: torch.Tensor  # (f, H) the front's features
    parents: torch.Tensor  # (b,) rows of front
    tokens: torch.Tensor  # (b,)
    depth: int
    k: int

    @property
    def together(self) -> Hashable:
        return ("eagle-expand", id(self.source.model))

    @staticmethod
    def run_together(jobs: Sequence["EagleExpandStep"]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [j.source.expand(j.front, j.parents, j.tokens, j.depth, j.k) for j in jobs]


class EagleSteps:
    """An :class:`EagleModel` as a ``drafters.proposers.StepSource`` (module docstring): its
    ``state`` is the next root's feature."""

    hidden_need = HiddenNeed.ALL

    def __init__(self, model: EagleModel, vocab_size: int):
        self.model, self.V = model, vocab_size
        self.hidden_layers = model.config.fused_layers  # EAGLE-3's low- and mid-level states beside h
        self.depth = int(model.config.depth)
        dv = model.draft_vocab
        self.ranked = int((dv < vocab_size).sum()) if dv is not None else vocab_size
        self.observe_ms = 0.0
        self.cache: EagleCache | None = EagleCache()
        self.state: torch.Tensor | None = None
        self._tree = _TreeSight()
        self._front_slots: list[int] = [-1]

    # ---- the committed pairs ---------------------------------------------------------------
    def _commit(self, hidden: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """Pairs (hidden (n, W): [h ; the fused layers' states], tokens (n,)); the last one's feature
        becomes the next root's. No hidden states (a loop that does not pass them): the cache can no
        longer follow, and every later step proposes the root alone (plain decoding)."""
        if hidden is None or self.cache is None:
            self.cache, self.state = None, None
            return
        if hidden.dim() != 2 or hidden.shape[0] != tokens.shape[0]:
            raise ValueError(f"the EAGLE drafter needs the (n, H) target states of the {tokens.shape[0]} committed "
                             f"positions, got {tuple(hidden.shape)}")
        self.state = self.model.extend_last(self.cache, hidden, tokens)

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """``hidden`` (T-1, H): the target's states at ``prompt[:-1]``, paired with ``prompt[1:]``."""
        self.cache, self.state = EagleCache(), None
        if prompt.shape[0] > 1:
            self._commit(hidden, prompt[1:])

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None,
                drafted: torch.Tensor | None) -> None:
        """``hidden`` (len(path), H): the target's states at the accepted nodes, each paired with
        the token after it (the path's next node in ``drafted``, and ``next_token`` after the last)."""
        after = [int(drafted[i]) for i in path[1:]] if drafted is not None and len(path) > 1 else []
        self._commit(hidden, torch.tensor(after + [int(next_token)], dtype=torch.long))

    # ---- the tree's steps ------------------------------------------------------------------
    def root_job(self, state: torch.Tensor, root: torch.Tensor, k: int) -> EagleRootStep:
        self._tree, self._front_slots = _TreeSight(), [-1]
        if self.cache is not None:
            self.cache.unstage()
        return EagleRootStep(self, state, k)

    def expand_job(self, front: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, depth: int,
                   k: int) -> EagleExpandStep:
        return EagleExpandStep(self, front, parents, tokens, depth, k)

    @torch.no_grad()
    def expand(self, front: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, depth: int,
               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run :meth:`EagleModel.tree_step` for b nodes of ``depth`` (>= 1) whose parents are rows
        ``parents`` of ``front``; they become the next front."""
        slots = [self._front_slots[int(p)] for p in parents]
        sees = self._tree.rows(slots)
        positions = torch.full((tokens.shape[0],), self.cache.length - 1 + depth, dtype=torch.long)
        feats = self.model.tree_step(self.cache, sees, front[parents], tokens, positions)
        self._front_slots = self._tree.add(tokens.shape[0], sees)
        tok, logp = self.children(feats, depth + 1, k)
        return feats, tok, logp

    def children(self, features: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates below nodes of ``depth - 1`` with these features (n, H): the top-k tokens
        of lm_head(f) and their log-probabilities, (n, k) each."""
        return self.model.draft_topk(features, k, self.V, logprobs=True)

    def warm_up(self) -> None:
        with torch.no_grad():
            self.model.draft_topk(torch.zeros(1, self.model.config.hidden_size, dtype=self.model.dtype), 1, self.V)


def EagleDrafter(model: EagleModel, dynamic: DynamicTree, vocab_size: int,
                 lookup: LookupDrafter | None = None, sizer: TreeSizer | None = None) -> DynamicTreeDrafter:
    """The EAGLE drafter of the decoding loop: a dynamic tree (``dynamic``, ``lookup`` and
    ``sizer`` as for ``DynamicTreeDrafter``, depth at most ``model.config.depth``) grown by
    ``model`` (:class:`EagleSteps`)."""
    return DynamicTreeDrafter(Stepwise(EagleSteps(model, vocab_size)), dynamic, vocab_size, lookup, sizer)
