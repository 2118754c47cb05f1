"""The heads as tree proposers (``drafters.proposers``): Medusa's independent heads
(:class:`IndependentHeads`) and Hydra's sequential heads (:class:`SequentialSteps`), with the
jobs (``drafters.base.Job``) through which several sequences' drafts run as one call.

One target call per step: the verification pass that accepts a path also returns the final hidden
state ``h`` of the path's last node; the target's token after it becomes the next root, and the
heads applied to ``h`` propose the tokens below that root (head k predicts the token k + 2
positions after ``h``, see ``speculant.heads``). The loop hands ``h`` over through
``observe(path, next_token, hidden=...)``, as ``hidden_need = HiddenNeed.LAST`` asks. Without a
hidden state (the first step of a one-token prompt, or a loop that does not pass it) the drafter
proposes the root alone: plain decoding for one step.

With a context layer (``heads.context``: prefix attention of sequential heads) the heads' first
state is that layer's output over the hidden states of every committed position, so they ask the
loop for all of them (``hidden_need = HiddenNeed.ALL``) and keep the layer's keys and values in a
``ContextCache``.

Shapes: H hidden size, V the target vocabulary the loop verifies against, K heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

from ..heads import ContextCache, MedusaHeads, SequentialHeads
from ..trees.buffers import TreeBuffers
from .base import HiddenNeed, PassPlan
from .proposers import DepthBudget, best_first

__all__ = ["HeadsCandidates", "HeadsLike", "HeadsStep", "IndependentHeads", "SequentialSteps"]


class HeadsLike(Protocol):
    """Anything mapping a hidden state (H,) to head logits (K, V), e.g. ``MedusaHeads``."""

    num_heads: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


class _LastState:
    """The (H,) target state a step drafts from, kept from ``begin``/``observe``."""

    hidden_need = HiddenNeed.LAST
    hidden_layers = ()

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.observe_ms = 0.0

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """``hidden`` (H,): the target's state at ``prompt[-2]``, or None."""
        self.state = hidden

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None,
                drafted: torch.Tensor | None) -> None:
        """``hidden`` (H,): the target's final hidden state at node ``path[-1]``; None: the next
        step proposes the root alone."""
        if hidden is not None and hidden.dim() != 1:
            raise ValueError(f"hidden must be the (H,) state of the last accepted node, got {tuple(hidden.shape)}")
        self.state = hidden


class IndependentHeads(_LastState):
    """Medusa-style heads as a ``TreeProposer``: ``heads(hidden (H,)) -> (K, V')`` logits (V' >=
    vocab_size; cut to it); ``MedusaHeads`` rank through their low-bit shortlist."""

    def __init__(self, heads: HeadsLike, vocab_size: int):
        super().__init__()
        self.heads, self.V = heads, vocab_size
        self.depth = int(heads.num_heads)
        self.ranked = vocab_size
        self._shortlist = isinstance(heads, MedusaHeads)  # draft_topk: an int4 shortlist where it runs

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, k: int, depth: int) -> torch.Tensor:
        """hidden (H,) -> (depth, k) long: the top-k tokens of the first ``depth`` heads, by
        decreasing logit (the order of exact ties is unspecified, which only affects speed: the
        target verifies every token)."""
        if self._shortlist:
            return self.heads.draft_topk(hidden, k, depth, self.V)
        logits = self.heads(hidden)[:depth, : self.V]  # (depth, V)
        return logits.topk(k, dim=-1, sorted=True).indices

    @torch.no_grad()
    def candidates_logprobs(self, hidden: torch.Tensor, k: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`candidates` with their log-probabilities: (tokens (depth, k) long, log p (depth, k)).
        hidden (B, H), several sequences' states at once: (B, depth, k) each."""
        if self._shortlist:
            return self.heads.draft_topk(hidden, k, depth, self.V, logprobs=True)
        if hidden.dim() == 2:  # heads of the plain HeadsLike interface: one state at a time
            rows = [self.candidates_logprobs(h, k, depth) for h in hidden]
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        logp = self.heads(hidden)[:depth, : self.V].float().log_softmax(-1)  # (depth, V)
        val, idx = logp.topk(k, dim=-1, sorted=True)
        return idx, val

    def grow(self, state: torch.Tensor, root: torch.Tensor, nodes: int, top_k: int, beam: int, depth: int,
             budget: DepthBudget) -> PassPlan:
        """Best-first over the Cartesian product of the heads' top-k lists (one call for every depth)."""
        idx, val = yield HeadsCandidates(self, state, min(top_k, self.V), depth)  # (D, k) each
        return best_first(idx, val, nodes, depth)

    def static(self, state: torch.Tensor, root: torch.Tensor, tree: TreeBuffers) -> PassPlan:
        """The node at path (r_1, ..., r_d) holds the r_d-th ranked token of head d-1."""
        width = int(tree.ranks.max()) + 1
        cands, _ = yield HeadsCandidates(self, state, width, tree.depth)  # (depth, width)
        return cands[(tree.depths[1:] - 1).clamp(min=0), tree.ranks[1:]]

    @torch.no_grad()
    def warm_up(self) -> None:
        if self._shortlist:
            self.heads.draft_topk(torch.zeros(self.heads.config.hidden_size, dtype=self.heads.dtype), 1, 1, self.V)


class SequentialSteps(_LastState):
    """Sequential heads (``heads.SequentialHeads``) as a ``proposers.StepSource``: a node's
    children are the top-k of the heads' step from its parent's state and its own token. With a
    context layer the first state is the layer's output over every committed position."""

    def __init__(self, heads: SequentialHeads, vocab_size: int):
        super().__init__()
        self.heads, self.V = heads, vocab_size
        self.depth = int(heads.num_heads)
        dv = heads.draft_vocab
        self.ranked = int((dv < vocab_size).sum()) if dv is not None else vocab_size
        self.context = heads.context
        self.context_cache: ContextCache | None = None
        if self.context is not None:
            self.hidden_need = HiddenNeed.ALL

    @torch.no_grad()
    def first_state(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The target's hidden state(s) at the newly committed positions -> the heads' first state
        at the last one: that row itself, or (context layer) the layer's output there."""
        if self.context is None or hidden is None:
            return hidden
        if hidden.dim() != 2 or hidden.shape[0] < 1:
            raise ValueError(f"a context layer needs the (n, H) states of every committed position, got "
                             f"{tuple(hidden.shape)}")
        return self.context.extend(self.context_cache, hidden.to(self.heads.dtype))[-1]

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """``hidden`` (H,), or with a context layer the (T-1, H) states of ``prompt[:-1]``."""
        self.context_cache = ContextCache() if self.context is not None else None
        self.state = self.first_state(hidden)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None,
                drafted: torch.Tensor | None) -> None:
        """``hidden`` (H,), or with a context layer the (len(path), H) states of the accepted nodes."""
        if self.context is None:
            super().observe(path, next_token, hidden, drafted)
            return
        if hidden is not None and hidden.shape[0] != len(path):
            raise ValueError(f"a context layer needs the states of the {len(path)} accepted nodes, got "
                             f"{tuple(hidden.shape)}")
        t = time.perf_counter()
        self.state = self.first_state(hidden)
        self.observe_ms = (time.perf_counter() - t) * 1e3

    def root_job(self, state: torch.Tensor, root: torch.Tensor, k: int) -> "HeadsStep":
        return HeadsStep(self.heads, state[None], root.view(1), k, self.V)

    def expand_job(self, front: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, depth: int,
                   k: int) -> "HeadsStep":
        return HeadsStep(self.heads, front[parents], tokens, k, self.V)

    @torch.no_grad()
    def warm_up(self) -> None:
        self.heads.draft_topk(torch.zeros(1, self.heads.config.hidden_size, dtype=self.heads.dtype), 1, self.V)


# ---- the heads' work as Jobs (drafters.base): several sequences' drafts in one call ----------
@dataclass(frozen=True, eq=False)
class HeadsCandidates:
    """Independent heads at one sequence's state: ``hidden`` (H,) -> (tokens (depth, k) long,
    log p (depth, k)), as ``IndependentHeads.candidates_logprobs``. Several sequences' run as one
    call on their (B, H) states."""
    proposer: IndependentHeads
    hidden: torch.Tensor
    k: int
    depth: int

    @property
    def together(self) -> Hashable:
        return ("heads-candidates", id(self.proposer.heads), self.proposer.V, self.k, self.depth)

    @staticmethod
    @torch.no_grad()
    def run_together(jobs: Sequence["HeadsCandidates"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        j0 = jobs[0]
        idx, val = j0.proposer.candidates_logprobs(torch.stack([j.hidden for j in jobs]), j0.k, j0.depth)
        return [(idx[i], val[i]) for i in range(len(jobs))]


@dataclass(frozen=True, eq=False)
class HeadsStep:
    """Sequential heads, one depth of one sequence's tree: the heads' step from ``state`` (f, H)
    with ``tokens`` (f,) long, then the top-k of the new states -> (new states (f, H), tokens
    (f, k) long, log p (f, k)). Several sequences' run as one step and one projection over all
    their rows."""
    heads: SequentialHeads
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
