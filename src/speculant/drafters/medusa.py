"""Drafters reading the target's own hidden state: Medusa heads (a static sparse tree) and
blockwise parallel decoding (BPD, Stern et al. 2018: k heads, top-1 each, a chain).

One target call per step: the verification pass that accepts a path also returns the final
hidden state ``h`` of the path's last node; the target's token after it becomes the next root,
and head d-1 applied to ``h`` proposes the tokens of depth d below that root (head k predicts
the token k + 2 positions after ``h``, see ``speculant.heads``).

Tree semantics (Medusa's static sparse tree): the candidates of one depth are shared by every
parent of that depth, so a node with path ``(r_1, ..., r_d)`` holds the ``r_d``-th ranked token
of head ``d-1`` — the tree is a subset of the Cartesian product of the heads' top-k lists.

The loop hands the hidden state over through ``observe(path, next_token, hidden=...)``; the
drafter asks for it with ``hidden_need = HiddenNeed.LAST``. Without a hidden state (the first
step, or a loop that does not pass it) the drafter proposes the root alone: plain decoding for one
step.
Proposals are deterministic (``Draft.q is None``).

Sequential heads (``heads.conditioned``, :class:`speculant.heads.SequentialHeads`) also read the
tokens of the path they extend: the tree is then expanded depth by depth, a node's children being
the top-ranked tokens of the heads' step from that node's own state (one projection per depth, over
the nodes of that depth that have children). The same path lists describe both kinds of tree.
With a context layer (``heads.context``, prefix attention) the heads' first state is that layer's
output over the hidden states of every committed position, so the drafter asks the loop for all of
them (``hidden_need = HiddenNeed.ALL``) and keeps the layer's keys and values in a ``ContextCache``.

Optionally (``lookup``) the tree gets one more branch under the root: a chain of the tokens that
followed the latest earlier occurrence of the context's last n-gram (prompt lookup), unfilled
(-1, never accepted) where there is no match. It costs ``lookup.gamma`` tree rows and pays on
text that copies its context (summaries, retrieval-augmented answers, code edits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ConfigError
from ..heads import ContextCache
from ..tree import TreeBuffers, chain, compile_paths
from .base import Draft, HiddenNeed
from .lookup import LookupDrafter
from .sizing import TreeSizer

__all__ = ["BlockwiseDrafter", "DynamicTree", "HeadsLike", "MedusaDrafter"]


@dataclass(frozen=True)
class DynamicTree:
    """A draft tree grown anew at every step from the heads' own probabilities (EAGLE-2's
    context-aware dynamic tree, Li et al. 2024).

    Each drafted node gets the score ``Π p(token | path)`` along its path (the heads' estimate of
    the chance that the target accepts the whole path). Depth by depth, the ``beam`` best-scored
    nodes of the last depth are expanded, each with its ``top_k`` best children; after ``depth``
    depths the ``nodes`` best-scored nodes of all those drafted make the tree (a child never
    scores above its parent, so the set is closed under ancestors). A static tree spends its
    nodes where the heads are right on average; this one where they are confident right now.
    Medusa heads (one candidate list per depth, shared by every parent) need no beam: every
    path's score is known from one call, and the best ``nodes`` are found best-first.
    """

    nodes: int = 15  # + the root: 16 rows. Why: docs/design-notes.md#tree-rows
    depth: int = 0  # 0: as deep as the heads go (K)
    # Why 16 children and a beam of 4: docs/design-notes.md#dynamic-tree-beam
    top_k: int = 16
    beam: int = 4

    def __post_init__(self) -> None:
        for name in ("nodes", "depth", "top_k", "beam"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "depth" else 1):
                raise ConfigError(f"dynamic tree {name} must be an integer >= {0 if name == 'depth' else 1}, "
                                  f"got {value!r}")

    @classmethod
    def parse(cls, spec: str) -> "DynamicTree":
        """``"dynamic"``, ``"dynamic:N"`` (N nodes) or ``"dynamic:N:D"`` (and depth D)."""
        parts = spec.strip().lower().split(":")
        if parts[0] != "dynamic" or len(parts) > 3:
            raise ConfigError(f"malformed dynamic tree {spec!r}: use dynamic, dynamic:N (nodes) or dynamic:N:D "
                              "(nodes, depth)")
        try:
            nums = [int(x) for x in parts[1:]]
        except ValueError:
            raise ConfigError(f"malformed dynamic tree {spec!r}: N and D must be integers, e.g. dynamic:20:4") from None
        return cls(*nums)


class HeadsLike(Protocol):
    """Anything mapping a hidden state (H,) to head logits (K, V), e.g. ``MedusaHeads``; with
    ``conditioned = True`` also ``step(state (n, H), tokens (n,)) -> (n, H)`` and
    ``project(state (n, H)) -> (n, V)`` (``SequentialHeads``)."""

    num_heads: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


class MedusaDrafter:
    """Proposes ``tree`` from the heads' top-k lists (greedy, deterministic).

    heads: K heads, ``heads(hidden (H,)) -> (K, V')`` logits (V' >= vocab_size; cut to it).
    tree: compiled static tree; its depth must be <= K, its widest rank < vocab_size.
    vocab_size: the target vocabulary the loop verifies against.
    lookup: optional n-gram drafter whose chain (``lookup.gamma`` nodes) becomes one more branch
    under the root (rank = the heads' tree width); ``self.tree`` is then the combined tree.
    dynamic: grow the tree per step (:class:`DynamicTree`) instead of using ``tree``.
    sizer: with a dynamic tree, size every step's tree against the machine's pass cost
    (:class:`~speculant.drafters.sizing.TreeSizer`; ``dynamic.nodes`` + the chain is then the most
    drafted); without one, every step verifies ``dynamic.nodes`` + the chain's length.
    """

    hidden_need = HiddenNeed.LAST  # the loop passes hidden=out.hidden[path[-1]] to observe()

    def __init__(self, heads: HeadsLike, tree: TreeBuffers, vocab_size: int, lookup: LookupDrafter | None = None,
                 dynamic: DynamicTree | None = None, sizer: TreeSizer | None = None):
        K = int(heads.num_heads)
        self.dynamic = dynamic
        if sizer is not None and dynamic is None:
            raise ConfigError("tree sizing against the pass cost needs a dynamic tree (--tree dynamic...): a static "
                              "tree has a fixed size")
        self.sizer = sizer
        if dynamic is not None:
            if dynamic.depth > K:
                raise ConfigError(f"the dynamic tree has depth {dynamic.depth} but the heads are trained for {K}: "
                                  f"use depth <= {K} (0 = {K})")
            self._dyn_depth = dynamic.depth or K
            tree = compile_paths([(r,) for r in range(dynamic.top_k)]
                                 + [(0,) * d for d in range(2, self._dyn_depth + 1)])  # for the checks below
        if tree.depth > K:
            raise ConfigError(
                f"the tree has depth {tree.depth} but there are only {K} heads (depth d is drafted by head d-1): "
                f"use a tree of depth <= {K}, or a heads checkpoint with more heads")
        width = int(tree.ranks.max()) + 1
        if width > vocab_size:
            raise ConfigError(f"the tree asks for rank {width - 1} candidates but the vocabulary has {vocab_size} tokens")
        self.heads, self.tree, self.heads_tree, self.V = heads, tree, tree, vocab_size
        self.conditioned = bool(getattr(heads, "conditioned", False))
        self.width = width  # top-k taken from every head
        dv = getattr(heads, "draft_vocab", None)
        drafted = int((dv < vocab_size).sum()) if self.conditioned and dv is not None else vocab_size
        if width > drafted:
            raise ConfigError(f"the tree asks for rank {width - 1} candidates but the heads' draft vocabulary has "
                              f"{drafted} tokens")
        self._head_of = (tree.depths[1:] - 1).clamp(min=0)  # (N-1,) head drafting each non-root node
        self._rank_of = tree.ranks[1:]  # (N-1,)
        self.depth = tree.depth  # heads drafting: 0 .. depth-1
        self.lookup = lookup
        if lookup is not None:  # the combined tree; where the heads' nodes and the chain's nodes are in it
            r = int(tree.children[0].ge(0).sum())
            branch = [(r,) + (0,) * d for d in range(lookup.gamma)]
            both = compile_paths(list(tree.paths[1:]) + branch)
            self._heads_nodes = torch.tensor([both.paths.index(p) for p in tree.paths[1:]], dtype=torch.long)
            self._branch = torch.tensor([both.paths.index(p) for p in branch], dtype=torch.long)
            self.tree = both
        self.hidden: torch.Tensor | None = None  # (H,) the heads' first state before the next root
        self.head_calls = 0
        # sequential heads with a context layer read every committed position's hidden state: the
        # loop then passes all of them (prefill rows, accepted path) instead of the last one
        self.context = getattr(heads, "context", None) if self.conditioned else None
        if self.context is not None:
            self.hidden_need = HiddenNeed.ALL
        self._context_cache: ContextCache | None = None
        self._observe_ms = 0.0

    @torch.no_grad()
    def _first_state(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The target's hidden state(s) at the newly committed positions -> the heads' first state
        at the last one: that row itself, or (context layer) the layer's output there. hidden: (H,),
        or (n, H) with a context layer."""
        if self.context is None or hidden is None:
            return hidden
        if hidden.dim() != 2 or hidden.shape[0] < 1:
            raise ValueError(f"a context layer needs the (n, H) states of every committed position, got "
                             f"{tuple(hidden.shape)}")
        return self.context.extend(self._context_cache, hidden.to(self.heads.dtype))[-1]

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """New sequence. ``hidden`` (H,), optional: the target's hidden state at ``prompt[-2]``
        (the row before the first root), if the loop's prefill returns it; with a context layer
        (``HiddenNeed.ALL``), the (T-1, H) states of ``prompt[:-1]``."""
        self._context_cache = ContextCache() if self.context is not None else None
        self.hidden = self._first_state(hidden)

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (H,) -> (K', width) long: the top-``width`` tokens of the first K' = depth heads,
        by decreasing logit (``topk``, O(V); the order of exact ties is unspecified, which only
        affects speed: the target verifies every token)."""
        if hasattr(self.heads, "draft_topk"):  # MedusaHeads: an int4 shortlist where it runs
            return self.heads.draft_topk(hidden, self.width, self.depth, self.V)
        logits = self.heads(hidden)[: self.depth, : self.V]  # (K', V)
        return logits.topk(self.width, dim=-1, sorted=True).indices

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

    @torch.no_grad()
    def grow(self, hidden: torch.Tensor, root: torch.Tensor,
             nodes: int | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        """Dynamic tree (``self.dynamic``): hidden (H,), root (1,) long -> (paths, tokens): the
        ``nodes`` (default ``self.dynamic.nodes``) chosen nodes' paths (ranks among their parent's
        children, in the heads' order) and their tokens (len(paths),) long, best-scored first (so
        every prefix of the list is a tree too)."""
        paths, tokens, _ = self.grow_scored(hidden, root, nodes)
        return paths, tokens

    @torch.no_grad()
    def grow_scored(self, hidden: torch.Tensor, root: torch.Tensor,
                    nodes: int | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor, list[float]]:
        """:meth:`grow`, plus each node's score: log Π p(token | path) along its path (<= 0,
        non-increasing down the list)."""
        nodes = self.dynamic.nodes if nodes is None else nodes
        if not self.conditioned:
            return self._grow_independent(hidden, nodes)
        cfg, heads = self.dynamic, self.heads
        state = heads.step(hidden[None], root.view(1))  # (1, H)
        front_paths: list[tuple[int, ...]] = [()]
        front_score = torch.zeros(1)
        scores, paths, toks = [], [], []
        depth = self._dyn_depth
        for d in range(1, depth + 1):
            tok, logp = heads.draft_topk(state, cfg.top_k, self.V, logprobs=True)  # (f, k) each
            sc = front_score[:, None] + logp.float().clamp(max=0.0)  # (f, k): log Π p along the path
            k = tok.shape[1]
            scores.append(sc.flatten())
            toks.append(tok.flatten())
            paths.extend(fp + (r,) for fp in front_paths for r in range(k))
            if d == depth:
                break
            flat = sc.flatten()
            best = flat.topk(min(cfg.beam, flat.numel())).indices  # (b,) expanded at the next depth
            state = heads.step(state[best // k], tok.flatten()[best])
            front_paths = [front_paths[i // k] + (i % k,) for i in best.tolist()]
            front_score = flat[best]
        score = torch.cat(scores).tolist()
        tokens = torch.cat(toks)
        # the best `nodes` (ties: shallower, then lower ranks first): closed under ancestors and
        # without rank gaps, since a child never scores above its parent nor above an older sibling
        order = sorted(range(len(paths)), key=lambda i: (-score[i], len(paths[i]), paths[i]))[:nodes]
        return [paths[i] for i in order], tokens[order], [score[i] for i in order]

    def _grow_independent(self, hidden: torch.Tensor,
                          nodes: int) -> tuple[list[tuple[int, ...]], torch.Tensor, list[float]]:
        """Medusa heads: depth d's candidates are head d-1's top-k under every parent, so a path's
        score is the sum of its ranks' log-probabilities; the best ``nodes`` paths are found
        best-first (a child never scores above its parent: the first ``nodes`` popped are the best)."""
        import heapq

        cfg = self.dynamic
        k = min(cfg.top_k, self.V)
        if hasattr(self.heads, "draft_topk"):  # MedusaHeads: through the low-bit shortlist where it runs
            idx, val = self.heads.draft_topk(hidden, k, self._dyn_depth, self.V, logprobs=True)  # (D, k) each
        else:
            logp = self.heads(hidden)[: self._dyn_depth, : self.V].float().log_softmax(-1)  # (D, V)
            val, idx = logp.topk(k, dim=-1, sorted=True)
        val, ranked, k = val.tolist(), idx.tolist(), idx.shape[1]
        heap = [(-min(val[0][r], 0.0), (r,)) for r in range(k)]  # (−score, path): ties -> shallower, lower ranks
        heapq.heapify(heap)
        paths, tokens, scores = [], [], []
        while heap and len(paths) < nodes:
            neg, path = heapq.heappop(heap)
            paths.append(path)
            tokens.append(ranked[len(path) - 1][path[-1]])
            scores.append(-neg)
            if len(path) < self._dyn_depth:
                for r in range(k):
                    heapq.heappush(heap, (neg - min(val[len(path)][r], 0.0), path + (r,)))
        return paths, torch.tensor(tokens, dtype=torch.long), scores

    def _dynamic_draft(self, context: torch.Tensor, root: torch.Tensor) -> Draft:
        """The grown tree, plus (with ``lookup``) the prompt-lookup chain merged into it.

        The chain follows the heads' nodes as long as its tokens are already there and only its
        remaining tokens get new rows. Without a cost model the tree always has 1 + nodes + gamma
        rows (one verification cost): the rows the chain does not need (a short or no match, or
        tokens the heads drafted too) go to the heads' next-best nodes. With one
        (``self.sizer``) the step takes the split of heads' nodes and chain rows that maximizes
        expected tokens per millisecond (:class:`TreeSizer`)."""
        budget = self.dynamic.nodes + (self.lookup.gamma if self.lookup is not None else 0)
        paths, heads_tokens, scores = self.grow_scored(self.hidden, root, budget)
        toks = heads_tokens.tolist()
        cont: list[int] = []
        walk: list[int] = []  # the chain's positions in the best-first order while it follows the heads
        if self.lookup is not None:
            cont = self.lookup.find(context).tolist()
            where = {(p[:-1], t): i for i, (p, t) in enumerate(zip(paths, toks))}  # (parent, token) -> order
            parent = ()
            for t in cont:
                i = where.get((parent, t))
                if i is None:
                    break
                walk.append(i)
                parent = paths[i]
        if self.sizer is not None:
            m, c = self.sizer.choose(scores, walk, len(cont), context=int(context.shape[0]))
        else:
            # the most heads' nodes m such that they and the chain's unmatched rest fit the budget
            # (positions increase along the walk: ancestors come first in the best-first order)
            m = len(paths)
            while m > 0 and m + len(cont) - sum(i < m for i in walk) > budget:
                m -= 1
            c = len(cont) - sum(i < m for i in walk)
        matched = sum(i < m for i in walk)
        parent = paths[walk[matched - 1]] if matched else ()
        rank = sum(1 for p in paths[:m] if p[:-1] == parent)  # first free rank under the parent
        branch = [(parent + (rank,) + (0,) * d, t) for d, t in enumerate(cont[matched:matched + c])]
        by_path = dict(zip(paths[:m], toks[:m]))
        by_path.update(branch)
        tree = compile_paths(list(by_path))
        tokens = torch.tensor([int(root[0])] + [by_path[p] for p in tree.paths[1:]], dtype=torch.long)
        if self.sizer is not None:
            self.sizer.drafted(tokens, cont[:matched + c], scores[:m])
        return Draft(tree, tokens)

    def propose(self, context: torch.Tensor) -> Draft:
        root = context[-1:]
        if self.hidden is None or self.depth == 0:
            return Draft(chain(0), root.clone())
        self.head_calls += 1
        if self.dynamic is not None:
            if self.sizer is None:
                return self._dynamic_draft(context, root)
            t = time.perf_counter()
            draft = self._dynamic_draft(context, root)
            self.sizer.drafting_took((time.perf_counter() - t) * 1e3 + self._observe_ms)
            return draft
        if self.conditioned:
            heads_tokens = self.expand(self.hidden, root)
        else:
            cands = self.candidates(self.hidden)  # (D, width)
            heads_tokens = cands[self._head_of, self._rank_of]  # (N_heads - 1,)
        if self.lookup is None:
            return Draft(self.tree, torch.cat([root, heads_tokens]))
        tokens = torch.full((self.tree.size,), -1, dtype=torch.long)
        tokens[0] = root[0]
        tokens[self._heads_nodes] = heads_tokens
        cont = self.lookup.find(context)
        tokens[self._branch[: cont.shape[0]]] = cont
        return Draft(self.tree, tokens)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """``hidden`` (H,): the target's final hidden state at node ``path[-1]`` (the one whose
        output produced ``next_token``); with a context layer, the (len(path), H) states of every
        node of ``path``. None falls back to a root-only proposal."""
        if hidden is not None and self.context is None and hidden.dim() != 1:
            raise ValueError(f"hidden must be the (H,) state of the last accepted node, got {tuple(hidden.shape)}")
        if hidden is not None and self.context is not None and hidden.shape[0] != len(path):
            raise ValueError(f"a context layer needs the states of the {len(path)} accepted nodes, got "
                             f"{tuple(hidden.shape)}")
        t = time.perf_counter()
        self.hidden = self._first_state(hidden)
        self._observe_ms = (time.perf_counter() - t) * 1e3  # a context layer's step: drafting cost too
        if self.sizer is not None:
            self.sizer.observe(path)


class BlockwiseDrafter(MedusaDrafter):
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
