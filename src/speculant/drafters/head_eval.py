"""Reading the heads, shared by the drafters that draft from the target's own hidden state
(``static_tree.StaticTreeDrafter``, ``dynamic_tree.DynamicTreeDrafter``).

One target call per step: the verification pass that accepts a path also returns the final hidden
state ``h`` of the path's last node; the target's token after it becomes the next root, and the
heads applied to ``h`` propose the tokens below that root (head k predicts the token k + 2
positions after ``h``, see ``speculant.heads``). The loop hands ``h`` over through
``observe(path, next_token, hidden=...)``, as ``hidden_need = HiddenNeed.LAST`` asks. Without a
hidden state (the first step of a one-token prompt, or a loop that does not pass it) the drafter
proposes the root alone: plain decoding for one step. Proposals are deterministic
(``Draft.q is None``).

With a context layer (``heads.context``: prefix attention of sequential heads) the heads' first
state is that layer's output over the hidden states of every committed position, so the drafter
asks the loop for all of them (``hidden_need = HiddenNeed.ALL``) and keeps the layer's keys and
values in a ``ContextCache``.

Shapes: H hidden size, V the target vocabulary the loop verifies against, K heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

from ..errors import ConfigError
from ..heads import ContextCache
from ..tree import TreeBuffers
from .base import HiddenNeed

__all__ = ["HeadEvaluator", "HeadsCandidates", "HeadsDrafter", "HeadsLike", "HeadsStep"]


class HeadsLike(Protocol):
    """Anything mapping a hidden state (H,) to head logits (K, V), e.g. ``MedusaHeads``; with
    ``conditioned = True`` also ``step(state (n, H), tokens (n,)) -> (n, H)`` and
    ``project(state (n, H)) -> (n, V)`` (``SequentialHeads``)."""

    num_heads: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


class HeadEvaluator:
    """The heads with the state they draft from.

    heads: K heads (:class:`HeadsLike`). vocab_size: V; candidates are cut to it.
    ``hidden`` (H,): the heads' first state before the next root, or None; set by :meth:`begin` and
    :meth:`observe` from the target's hidden state(s). ``observe_ms``: what the last
    :meth:`observe` took (a context layer's step, part of the drafting cost)."""

    def __init__(self, heads: HeadsLike, vocab_size: int):
        self.heads, self.V = heads, vocab_size
        self.num_heads = int(heads.num_heads)
        self.conditioned = bool(getattr(heads, "conditioned", False))
        self.context = getattr(heads, "context", None) if self.conditioned else None
        self.hidden_need = HiddenNeed.LAST if self.context is None else HiddenNeed.ALL
        self.hidden: torch.Tensor | None = None
        self.context_cache: ContextCache | None = None
        self.observe_ms = 0.0

    def check_tree(self, tree: TreeBuffers) -> int:
        """The top-k every depth of ``tree`` needs (its widest rank + 1), checked against the heads
        (depth d is drafted by head d-1), the vocabulary and the heads' draft vocabulary."""
        K = self.num_heads
        if tree.depth > K:
            raise ConfigError(
                f"the tree has depth {tree.depth} but there are only {K} heads (depth d is drafted by head d-1): "
                f"use a tree of depth <= {K}, or a heads checkpoint with more heads")
        width = int(tree.ranks.max()) + 1
        if width > self.V:
            raise ConfigError(f"the tree asks for rank {width - 1} candidates but the vocabulary has {self.V} tokens")
        dv = getattr(self.heads, "draft_vocab", None)
        drafted = int((dv < self.V).sum()) if self.conditioned and dv is not None else self.V
        if width > drafted:
            raise ConfigError(f"the tree asks for rank {width - 1} candidates but the heads' draft vocabulary has "
                              f"{drafted} tokens")
        return width

    # ---- the first state ---------------------------------------------------------------------
    @torch.no_grad()
    def first_state(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The target's hidden state(s) at the newly committed positions -> the heads' first state
        at the last one: that row itself, or (context layer) the layer's output there. hidden: (H,),
        or (n, H) with a context layer."""
        if self.context is None or hidden is None:
            return hidden
        if hidden.dim() != 2 or hidden.shape[0] < 1:
            raise ValueError(f"a context layer needs the (n, H) states of every committed position, got "
                             f"{tuple(hidden.shape)}")
        return self.context.extend(self.context_cache, hidden.to(self.heads.dtype))[-1]

    def begin(self, hidden: torch.Tensor | None) -> None:
        """New sequence: ``hidden`` as :class:`~speculant.drafters.base.Drafter` ``begin`` gets it."""
        self.context_cache = ContextCache() if self.context is not None else None
        self.hidden = self.first_state(hidden)

    def observe(self, path: list[int], hidden: torch.Tensor | None) -> None:
        """``hidden`` (H,): the target's final hidden state at node ``path[-1]``; with a context
        layer, the (len(path), H) states of every node of ``path``. None: the next step proposes
        the root alone."""
        if hidden is not None and self.context is None and hidden.dim() != 1:
            raise ValueError(f"hidden must be the (H,) state of the last accepted node, got {tuple(hidden.shape)}")
        if hidden is not None and self.context is not None and hidden.shape[0] != len(path):
            raise ValueError(f"a context layer needs the states of the {len(path)} accepted nodes, got "
                             f"{tuple(hidden.shape)}")
        t = time.perf_counter()
        self.hidden = self.first_state(hidden)
        self.observe_ms = (time.perf_counter() - t) * 1e3

    # ---- independent heads' candidates -------------------------------------------------------
    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, k: int, depth: int) -> torch.Tensor:
        """hidden (H,) -> (depth, k) long: the top-k tokens of the first ``depth`` heads, by
        decreasing logit (``topk``, O(V); the order of exact ties is unspecified, which only
        affects speed: the target verifies every token)."""
        if hasattr(self.heads, "draft_topk"):  # MedusaHeads: an int4 shortlist where it runs
            return self.heads.draft_topk(hidden, k, depth, self.V)
        logits = self.heads(hidden)[:depth, : self.V]  # (depth, V)
        return logits.topk(k, dim=-1, sorted=True).indices

    @torch.no_grad()
    def candidates_logprobs(self, hidden: torch.Tensor, k: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`candidates` with their log-probabilities: (tokens (depth, k) long, log p (depth, k)).
        hidden (B, H), several sequences' states at once: (B, depth, k) each."""
        if hasattr(self.heads, "draft_topk"):  # MedusaHeads: through the low-bit shortlist where it runs
            return self.heads.draft_topk(hidden, k, depth, self.V, logprobs=True)
        if hidden.dim() == 2:  # heads of the plain HeadsLike interface: one state at a time
            rows = [self.candidates_logprobs(h, k, depth) for h in hidden]
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        logp = self.heads(hidden)[:depth, : self.V].float().log_softmax(-1)  # (depth, V)
        val, idx = logp.topk(k, dim=-1, sorted=True)
        return idx, val


# ---- the heads' work as Jobs (drafters.base): several sequences' drafts in one call ----------
@dataclass(frozen=True, eq=False)
class HeadsCandidates:
    """Independent heads at one sequence's state: ``hidden`` (H,) -> (tokens (depth, k) long,
    log p (depth, k)), as ``HeadEvaluator.candidates_logprobs``. Several sequences' run as one
    call on their (B, H) states."""
    evaluator: HeadEvaluator
    hidden: torch.Tensor
    k: int
    depth: int

    @property
    def together(self) -> Hashable:
        return ("heads-candidates", id(self.evaluator.heads), self.evaluator.V, self.k, self.depth)

    @staticmethod
    @torch.no_grad()
    def run_together(jobs: Sequence["HeadsCandidates"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        j0 = jobs[0]
        idx, val = j0.evaluator.candidates_logprobs(torch.stack([j.hidden for j in jobs]), j0.k, j0.depth)
        return [(idx[i], val[i]) for i in range(len(jobs))]


@dataclass(frozen=True, eq=False)
class HeadsStep:
    """Sequential heads, one depth of one sequence's tree: the heads' step from ``state`` (f, H)
    with ``tokens`` (f,) long, then the top-k of the new states -> (new states (f, H), tokens
    (f, k) long, log p (f, k)). Several sequences' run as one step and one projection over all
    their rows."""
    heads: HeadsLike
    state: torch.Tensor
    tokens: torch.Tensor
    k: int
    limit: int

    @property
    def together(self) -> Hashable:
        return ("heads-step", id(self.heads), self.k, self.limit)

    @staticmethod
    @torch.no_grad()
    def run_together(jobs: Sequence["HeadsStep"]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        j0 = jobs[0]
        sizes = [j.state.shape[0] for j in jobs]
        state = j0.heads.step(torch.cat([j.state for j in jobs]), torch.cat([j.tokens for j in jobs]))
        tok, logp = j0.heads.draft_topk(state, j0.k, j0.limit, logprobs=True)
        return list(zip(state.split(sizes), tok.split(sizes), logp.split(sizes)))


class HeadsDrafter:
    """The Drafter plumbing of the heads' tree drafters: ``begin`` and ``observe`` feed a
    :class:`HeadEvaluator`; ``head_calls`` counts the steps that drafted. Subclasses own the tree
    policy (``propose``)."""

    def __init__(self, heads: HeadsLike, vocab_size: int):
        self.evaluator = HeadEvaluator(heads, vocab_size)
        self.heads, self.V = heads, vocab_size
        self.conditioned = self.evaluator.conditioned
        self.context = self.evaluator.context
        self.hidden_need = self.evaluator.hidden_need
        self.head_calls = 0

    @property
    def hidden(self) -> torch.Tensor | None:
        """(H,) the heads' first state before the next root, or None."""
        return self.evaluator.hidden

    @hidden.setter
    def hidden(self, value: torch.Tensor | None) -> None:
        self.evaluator.hidden = value

    @property
    def _context_cache(self) -> ContextCache | None:
        return self.evaluator.context_cache

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """New sequence. ``hidden`` (H,), optional: the target's hidden state at ``prompt[-2]``
        (the row before the first root), if the loop's prefill returns it; with a context layer
        (``HiddenNeed.ALL``), the (T-1, H) states of ``prompt[:-1]``."""
        self.evaluator.begin(hidden)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """``hidden`` (H,): the target's final hidden state at node ``path[-1]`` (the one whose
        output produced ``next_token``); with a context layer, the (len(path), H) states of every
        node of ``path``. None falls back to a root-only proposal."""
        self.evaluator.observe(path, hidden)
