"""What proposes a token tree's children, composed into the tree drafters (``static_tree``,
``dynamic_tree``): a :class:`TreeProposer`.

Two ways of proposing exist, each one class here:

- :class:`IndependentHeads` — Medusa heads: head d-1 ranks the tokens of depth d from the target's
  hidden state alone, the same candidates under every parent (one call gives every depth's top-k);
  a dynamic tree is the best of their Cartesian product (best-first).
- :class:`Stepwise` — a proposer that extends a node from its own state and token, depth by depth:
  Hydra's sequential heads (:class:`SequentialSteps`, ``drafters.head_steps``) and the EAGLE drafter
  (``eagle.drafter.EagleSteps``), behind the small :class:`StepSource` protocol; a dynamic tree is
  grown by beam search over the nodes' scores (EAGLE-2), a depth drafted only while its nodes can
  pay for its measured time (:class:`DepthBudget`).

:func:`proposer_for` gives the proposer of a heads module. Shapes: H hidden size, K the deepest
depth, k candidates per node, b nodes expanded at a depth.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import ConfigError
from ..trees.buffers import TreeBuffers
from .base import HiddenNeed, Job, PassPlan
from ..tuning.sizing import TreeSizer

__all__ = ["DepthBudget", "FollowsTarget", "Growth", "StepSource", "Stepwise", "TreeProposer", "check_tree",
           "proposer_for"]

# what a dynamic tree's growth returns: the chosen nodes' paths (ranks among their parent's
# children), their tokens (n,) long and scores (log Π p along the path), best first
Growth = tuple[list[tuple[int, ...]], torch.Tensor, list[float]]


@dataclass
class DepthBudget:
    """Whether a dynamic tree drafts one depth more: with a ``sizer``, only while the nodes it
    would expand can pay for its measured time (``ms``: a moving average of one depth's drafting
    time); without one, always."""

    sizer: TreeSizer | None = None
    ms: float = 0.0

    def worth_deeper(self, scores: list[float], rows: int) -> bool:
        return self.sizer is None or not self.ms or self.sizer.worth_deeper(scores, self.ms, rows=rows)

    def took(self, ms: float) -> None:
        self.ms = 0.8 * self.ms + 0.2 * ms if self.ms else ms


class FollowsTarget(Protocol):
    """What follows the target's hidden states to draft from them.

    ``hidden_need``: what ``begin``/``observe`` get (``drafters.base.HiddenNeed``), ``hidden_layers``
    the target layers whose input states join each of those rows (``Drafter.hidden_layers``); ``depth``: the
    deepest depth it drafts (K); ``ranked``: how many tokens it can rank (its draft vocabulary);
    ``state``: what it drafts the next root's children from, None when it cannot (the step then
    verifies the root alone); ``observe_ms``: what the last ``observe`` took (part of drafting)."""

    hidden_need: HiddenNeed
    hidden_layers: tuple[int, ...]
    depth: int
    ranked: int
    observe_ms: float

    @property
    def state(self) -> torch.Tensor | None: ...

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A new sequence (``hidden`` as ``Drafter.begin`` gets it)."""

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None,
                drafted: torch.Tensor | None) -> None:
        """The target accepted ``path`` of the last proposal, whose tokens were ``drafted`` (N,)."""

    def warm_up(self) -> None:
        """Build what the first drafting step would build (a low-bit shortlist)."""


class TreeProposer(FollowsTarget, Protocol):
    """Proposes the children of a tree's nodes from the target's hidden states."""

    def grow(self, state: torch.Tensor, root: torch.Tensor, nodes: int, top_k: int, beam: int, depth: int,
             budget: DepthBudget) -> PassPlan:
        """A plan (``drafters.base.PassPlan``) returning the :data:`Growth` of the best ``nodes``
        nodes below ``root`` (1,) long, at most ``depth`` deep, from ``state``."""

    def static(self, state: torch.Tensor, root: torch.Tensor, tree: TreeBuffers) -> PassPlan:
        """A plan returning the tokens (N-1,) long of ``tree``'s nodes below ``root``."""


def check_tree(proposer: TreeProposer, tree: TreeBuffers, vocab_size: int) -> int:
    """The top-k every depth of ``tree`` needs (its widest rank + 1), checked against the
    proposer's depth (depth d is drafted by head d-1), the vocabulary and its draft vocabulary."""
    K = proposer.depth
    if tree.depth > K:
        raise ConfigError(
            f"the tree has depth {tree.depth} but there are only {K} heads (depth d is drafted by head d-1): "
            f"use a tree of depth <= {K}, or a heads checkpoint with more heads")
    width = int(tree.ranks.max()) + 1
    if width > vocab_size:
        raise ConfigError(f"the tree asks for rank {width - 1} candidates but the vocabulary has {vocab_size} tokens")
    if width > proposer.ranked:
        raise ConfigError(f"the tree asks for rank {width - 1} candidates but the heads' draft vocabulary has "
                          f"{proposer.ranked} tokens")
    return width


class StepSource(FollowsTarget, Protocol):
    """What :class:`Stepwise` grows a tree with: jobs (``drafters.base.Job``) that give a node's
    children from its state. ``root_job(state, root, k)`` -> (the root's state (1, H), its
    children's tokens (1, k) long, log p (1, k)); ``expand_job(front, parents, tokens, depth, k)``:
    b nodes of ``depth`` (their parents' rows ``parents`` (b,) of the previous job's states
    ``front``, their ``tokens`` (b,)) -> (their states (b, H), children tokens (b, k), log p
    (b, k)). Calls come in depth order, each expanding nodes of the previous call's output."""

    def root_job(self, state: torch.Tensor, root: torch.Tensor, k: int) -> Job: ...

    def expand_job(self, front: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, depth: int,
                   k: int) -> Job: ...


@dataclass(eq=False)
class Stepwise:
    """A :class:`TreeProposer` over a :class:`StepSource` (module doc)."""

    source: Any  # StepSource

    @property
    def hidden_need(self) -> HiddenNeed:
        return self.source.hidden_need

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.source.hidden_layers

    @property
    def depth(self) -> int:
        return self.source.depth

    @property
    def ranked(self) -> int:
        return self.source.ranked

    @property
    def state(self) -> torch.Tensor | None:
        return self.source.state

    @property
    def observe_ms(self) -> float:
        return self.source.observe_ms

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.source.begin(prompt, hidden)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None,
                drafted: torch.Tensor | None) -> None:
        self.source.observe(path, next_token, hidden, drafted)

    def warm_up(self) -> None:
        self.source.warm_up()

    def grow(self, state: torch.Tensor, root: torch.Tensor, nodes: int, top_k: int, beam: int, depth: int,
             budget: DepthBudget) -> PassPlan:
        """Beam search: depth by depth the ``beam`` best-scored nodes are expanded with their
        ``top_k`` children; the best ``nodes`` of all drafted are kept."""
        front_paths: list[tuple[int, ...]] = [()]
        front_score = torch.zeros(1)
        scores, paths, toks = [], [], []
        front, tok, logp = yield self.source.root_job(state, root, top_k)  # (1, H), (1, k) each
        for d in range(1, depth + 1):
            sc = front_score[:, None] + logp.float().clamp(max=0.0)  # (f, k): log Π p along the path
            k = tok.shape[1]
            scores.append(sc.flatten())
            toks.append(tok.flatten())
            paths.extend(fp + (r,) for fp in front_paths for r in range(k))
            if d == depth:
                break
            flat = sc.flatten()
            best = flat.topk(min(beam, flat.numel())).indices  # (b,) expanded at the next depth
            if not budget.worth_deeper(flat[best].tolist(), rows=1 + d):
                break  # the next depth would cost more than its nodes can return
            t = time.perf_counter()
            front, tok, logp = yield self.source.expand_job(front, best // k, tok.flatten()[best], d, top_k)
            budget.took((time.perf_counter() - t) * 1e3)
            front_paths = [front_paths[i // k] + (i % k,) for i in best.tolist()]
            front_score = flat[best]
        score = torch.cat(scores).tolist()
        tokens = torch.cat(toks)
        # the best `nodes` (ties: shallower, then lower ranks first): closed under ancestors and
        # without rank gaps, since a child never scores above its parent nor above an older sibling
        order = sorted(range(len(paths)), key=lambda i: (-score[i], len(paths[i]), paths[i]))[:nodes]
        return [paths[i] for i in order], tokens[order], [score[i] for i in order]

    def static(self, state: torch.Tensor, root: torch.Tensor, tree: TreeBuffers) -> PassPlan:
        """Level by level: a node's children are the top-ranked tokens of the step from that
        node's own state (one job per depth, over the nodes of that depth that have children)."""
        tokens = torch.empty(tree.size, dtype=torch.long)
        tokens[0] = root[0]
        front, front_nodes = None, torch.zeros(1, dtype=torch.long)  # the nodes whose states are front's rows
        for d in range(1, tree.depth + 1):
            nodes = tree.levels[d]
            k = int(tree.ranks[nodes].max()) + 1
            parent_nodes, row = torch.unique_consecutive(tree.parents[nodes], return_inverse=True)
            if d == 1:  # the root's children
                front, tok, _ = yield self.source.root_job(state, root, k)
            else:  # the nodes of depth d-1 that have children, each a child of a row of the front
                rows = torch.searchsorted(front_nodes, tree.parents[parent_nodes])
                front, tok, _ = yield self.source.expand_job(front, rows, tokens[parent_nodes], d - 1, k)
                front_nodes = parent_nodes
            tokens[nodes] = tok[row, tree.ranks[nodes]]
        return tokens[1:]


def proposer_for(heads, vocab_size: int) -> TreeProposer:
    """The :class:`TreeProposer` of ``heads``: an EAGLE drafter (``eagle.EagleModel``), sequential
    heads (``heads.SequentialHeads``), or any Medusa-style heads (``heads(hidden (H,)) -> (K, V')``
    logits, ``num_heads``)."""
    from ..eagle.model import EagleModel
    from ..heads import SequentialHeads
    from .head_steps import IndependentHeads, SequentialSteps

    if isinstance(heads, EagleModel):
        from ..eagle.drafter import EagleSteps

        return Stepwise(EagleSteps(heads, vocab_size))
    if isinstance(heads, SequentialHeads):
        return Stepwise(SequentialSteps(heads, vocab_size))
    return IndependentHeads(heads, vocab_size)


def draft_depth(heads) -> int:
    """The deepest depth ``heads`` (as :func:`proposer_for` takes them) draft."""
    from ..eagle.model import EagleModel

    return int(heads.config.depth if isinstance(heads, EagleModel) else heads.num_heads)


def best_first(idx: torch.Tensor, val: torch.Tensor, nodes: int, depth: int) -> Growth:
    """Independent heads: depth d's candidates are head d-1's top-k under every parent (idx, val:
    (D, k) tokens and log-probabilities), so a path's score is the sum of its ranks'
    log-probabilities; the best ``nodes`` paths of at most ``depth`` are found best-first (a
    child never scores above its parent: the first ``nodes`` popped are the best)."""
    val, ranked, k = val.tolist(), idx.tolist(), idx.shape[1]
    heap = [(-min(val[0][r], 0.0), (r,)) for r in range(k)]  # (−score, path): ties -> shallower, lower ranks
    heapq.heapify(heap)
    paths, tokens, scores = [], [], []
    while heap and len(paths) < nodes:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        tokens.append(ranked[len(path) - 1][path[-1]])
        scores.append(-neg)
        if len(path) < depth:
            for r in range(k):
                heapq.heappush(heap, (neg - min(val[len(path)][r], 0.0), path + (r,)))
    return paths, torch.tensor(tokens, dtype=torch.long), scores
