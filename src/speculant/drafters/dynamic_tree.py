"""Heads drafting a tree grown anew at every step from their own probabilities (EAGLE-2's
context-aware dynamic tree, Li et al. 2024), sized per step.

Size: without a cost model every step verifies ``nodes`` heads' nodes plus the lookup chain's
length (one verification cost; the rows the chain does not need go to the heads' next-best
nodes). With one (``sizer``, :class:`~speculant.tuning.sizing.TreeSizer`) every step takes the
split of heads' nodes and chain rows with the most expected tokens per millisecond on this
machine, and (sequential heads) a depth is drafted only while the nodes it would expand can pay
for its measured time (:meth:`TreeSizer.worth_deeper`; docs/design-notes.md#depth-drafted-only-while-it-can-pay).
What proposes the nodes: ``proposers`` (``head_steps`` for the heads); the lookup chain's merge:
``lookup_branch``. Shapes: H hidden size, K heads.
"""

from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from ..trees.buffers import chain, compile_paths
from ..trees.draft import Draft
from ..trees.dynamic import DynamicTree
from .base import HiddenNeed, PassPlan, drive
from .lookup import LookupDrafter
from .lookup_branch import follow_heads, merge_chain
from .proposers import DepthBudget, TreeProposer, check_tree
from ..tuning.sizing import TreeSizer

__all__ = ["DynamicTree", "DynamicTreeDrafter"]


class DynamicTreeDrafter:
    """Proposes a :class:`DynamicTree` grown from a proposer at every step (greedy, deterministic).

    proposer: a ``drafters.proposers.TreeProposer`` (``proposers.proposer_for(heads, V)``: Medusa
    heads grow best-first, sequential heads and the EAGLE drafter by beam search); dynamic: the
    tree's shape (``dynamic.depth`` <= the proposer's). vocab_size: the target vocabulary the loop
    verifies against. lookup: optional n-gram drafter whose chain is merged into the tree. sizer:
    size every step's tree against the machine's pass cost (``dynamic.nodes`` + the chain is then
    the most drafted); without one, every step verifies ``dynamic.nodes`` + the chain's length.
    ``head_calls``: the steps that drafted; ``depth_ms``: one depth's measured drafting time.
    """

    def __init__(self, proposer: TreeProposer, dynamic: DynamicTree, vocab_size: int,
                 lookup: LookupDrafter | None = None, sizer: TreeSizer | None = None):
        K = proposer.depth
        if dynamic.depth > K:
            raise ConfigError(f"the dynamic tree has depth {dynamic.depth} but the heads are trained for {K}: "
                              f"use depth <= {K} (0 = {K})")
        self.proposer, self.V = proposer, vocab_size
        self.hidden_need: HiddenNeed = proposer.hidden_need
        self.hidden_layers: tuple[int, ...] = proposer.hidden_layers
        self.dynamic, self.lookup, self.sizer = dynamic, lookup, sizer
        self.depth = dynamic.depth or K  # heads drafting: 0 .. depth-1
        # with a sizer, a depth is drafted only while its nodes can pay for it (TreeSizer.worth_deeper)
        self.budget = DepthBudget(sizer)
        self.head_calls = 0
        self._drafted: torch.Tensor | None = None
        # the widest tree a step may draft, for the checks against the vocabularies
        check_tree(proposer, compile_paths([(r,) for r in range(dynamic.top_k)]
                                           + [(0,) * d for d in range(2, self.depth + 1)]), vocab_size)

    @property
    def depth_ms(self) -> float:
        """The measured time of one more depth (moving average, ms)."""
        return self.budget.ms

    @depth_ms.setter
    def depth_ms(self, ms: float) -> None:
        self.budget.ms = ms

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """New sequence. ``hidden``: the target's state(s) the proposer asks for (``hidden_need``)."""
        self.proposer.begin(prompt, hidden)
        if self.lookup is not None:
            self.lookup.begin(prompt)

    @torch.no_grad()
    def grow(self, hidden: torch.Tensor, root: torch.Tensor,
             nodes: int | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        """hidden: the proposer's state, root (1,) long -> (paths, tokens): the ``nodes`` (default
        ``self.dynamic.nodes``) chosen nodes' paths (ranks among their parent's children, in the
        proposer's order) and their tokens (len(paths),) long, best-scored first (so every prefix
        of the list is a tree too)."""
        paths, tokens, _ = self.grow_scored(hidden, root, nodes)
        return paths, tokens

    @torch.no_grad()
    def grow_scored(self, hidden: torch.Tensor, root: torch.Tensor,
                    nodes: int | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor, list[float]]:
        """:meth:`grow`, plus each node's score: log Π p(token | path) along its path (<= 0,
        non-increasing down the list)."""
        return drive(self._grow(hidden, root, self.dynamic.nodes if nodes is None else nodes))

    def _grow(self, state: torch.Tensor, root: torch.Tensor, nodes: int) -> PassPlan:
        cfg = self.dynamic
        return self.proposer.grow(state, root, nodes, cfg.top_k, cfg.beam, self.depth, self.budget)

    def _draft(self, context: torch.Tensor, root: torch.Tensor):
        """The grown tree, plus (with ``lookup``) the prompt-lookup chain merged into it; a plan
        of the proposer's calls that returns the Draft.

        Without a cost model the tree always has 1 + nodes + gamma rows: the rows the chain does
        not need (a short or no match, or tokens the heads drafted too) go to the heads' next-best
        nodes. With one (``self.sizer``) the step takes the split of heads' nodes and chain rows
        that maximizes expected tokens per millisecond (:class:`TreeSizer`)."""
        budget = self.dynamic.nodes + (self.lookup.gamma if self.lookup is not None else 0)
        paths, heads_tokens, scores = yield from self._grow(self.proposer.state, root, budget)
        toks = heads_tokens.tolist()
        cont, predicted = self.lookup.match(context) if self.lookup is not None else (context[:0], False)
        cont = cont.tolist()
        tree, tokens, chain_nodes, _ = sized_merge(self.sizer, root, paths, toks, scores, cont, budget,
                                                   int(context.shape[0]))
        return Draft(tree, tokens, predicted=chain_nodes if predicted else None)

    def propose(self, context: torch.Tensor) -> Draft:
        return drive(self.propose_passes(context))

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        """``propose`` as a plan of the proposer's calls (``drafters.base.PassPlan``), so that
        several sequences' drafters call it together (``batching``)."""
        root = context[-1:]
        if self.proposer.state is None:
            draft = Draft(chain(0), root.clone())
        else:
            self.head_calls += 1
            t = time.perf_counter()
            draft = yield from self._draft(context, root)
            if self.sizer is not None:  # in a batch: the whole drafting stage, which every member waits for
                self.sizer.drafting_took((time.perf_counter() - t) * 1e3 + self.proposer.observe_ms)
        self._drafted = draft.tokens
        return draft

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """``hidden``: the target's state(s) at the accepted nodes, as ``hidden_need`` asks. None
        falls back to a root-only proposal."""
        self.proposer.observe(path, next_token, hidden, self._drafted)
        self._drafted = None
        if self.sizer is not None:
            self.sizer.observe(path)


def sized_merge(sizer, root: torch.Tensor, paths: list[tuple[int, ...]], toks: list[int], scores: list[float],
                cont: list[int], budget: int, context: int):
    """The best-first nodes (``paths``, their tokens ``toks`` and log-``scores``) and a chain ``cont``
    merged into one tree, sized by ``sizer`` (None: :func:`fixed_split` of ``budget``) for a pass
    attending to ``context`` tokens; the sizer is told what was drafted. Returns (tree, tokens,
    chain_nodes, m): ``merge_chain``'s tree, tokens and chain nodes, and the nodes of ``paths`` kept."""
    walk = follow_heads(cont, paths, toks) if cont else []
    if sizer is not None:
        m, c = sizer.choose(scores, walk, len(cont), context=context)
    else:
        m, c = fixed_split(budget, len(paths), len(cont), walk)
    tree, tokens, matched, chain_nodes = merge_chain(root, paths, toks, m, cont, walk, c)
    if sizer is not None:
        sizer.drafted(tokens, cont[:matched + c], scores[:m])
    return tree, tokens, chain_nodes, m


def fixed_split(budget: int, n_nodes: int, n_chain: int, walk: list[int]) -> tuple[int, int]:
    """(m, c) for a fixed number of rows: the most heads' nodes m (of ``n_nodes`` best-first) such
    that they and the chain's rows they do not hold (c of ``n_chain``) fit ``budget``; ``walk`` as
    ``lookup_branch.follow_heads`` gives it (increasing: ancestors come first)."""
    m = n_nodes
    while m > 0 and m + n_chain - sum(i < m for i in walk) > budget:
        m -= 1
    return m, n_chain - sum(i < m for i in walk)
