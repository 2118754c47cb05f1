"""The decoding loop: prefill, then draft → verify → accept → commit until a stopping rule ends it.

Notation (used in stats): p = target distribution, q = draft distribution, γ = draft length.
α (acceptance rate) = accepted draft tokens / drafted positions, where a step drafts one
position per tree depth (a chain of γ drafts γ positions, a tree of depth D drafts D: only one
path can be accepted). ``acceptance_by_depth[d]`` = P(depth d+1 accepted | depth d reached).
τ (tokens per call) = new tokens / target verification calls (the prefill is not counted).
Every step yields the accepted draft tokens plus one token from the target: the *bonus* token
when the path reached a leaf, the *recovered* token (sampled from the residual) otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch

from .acceptance import accept_tree
from .backends.base import Backend, ForwardOut
from .config import AcceptanceConfig, SamplingConfig
from .drafters.base import Draft, Drafter, HiddenNeed
from .drafters.pacing import Pacer
from .errors import ConfigError
from .tree import chain

__all__ = ["DecodeState", "Stats", "Step", "StopRule", "decode"]


@dataclass
class Stats:
    target_calls: int = 0
    accepted_per_call: list[int] = field(default_factory=list)
    drafted_per_call: list[int] = field(default_factory=list)  # drafted positions (tree depth)
    drafted_by_depth: list[int] = field(default_factory=list)  # steps that reached depth d's parent
    accepted_by_depth: list[int] = field(default_factory=list)
    new_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0  # the target's prefill forward (part of verify_s)
    wall_s: float = 0.0
    plain_steps: int = 0  # steps verified as the root alone because drafting did not pay (drafters.pacing)
    acceptance: str = "exact"  # the rule that ran; anything but "exact" may change the output

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(self.drafted_per_call)
        return sum(self.accepted_per_call) / proposed if proposed else 0.0

    def to_dict(self) -> dict:
        by_depth = [a / d if d else 0.0 for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]
        return {
            "acceptance": self.acceptance,
            "lossless": self.acceptance == "exact",
            "target_calls": self.target_calls,
            "tokens_per_call": self.tokens_per_call,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_depth": by_depth,
            "accepted_per_call": list(self.accepted_per_call),
            "drafted_positions": sum(self.drafted_per_call),
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "prefill_s": self.prefill_s,
            "other_s": max(self.wall_s - self.draft_s - self.verify_s, 0.0),
            "wall_s": self.wall_s,
            "plain_steps": self.plain_steps,
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else 0.0,
        }


@dataclass(frozen=True)
class Step:
    """What one step committed: accepted draft tokens, then the target's token (-1 when the
    block was cut at EOS or at max_new_tokens before it)."""
    accepted: list[int]
    target_token: int

    @property
    def tokens(self) -> list[int]:
        """Every token the step committed, in order."""
        return self.accepted + ([self.target_token] if self.target_token >= 0 else [])


@dataclass
class DecodeState:
    """All mutable state of one generation."""
    context: torch.Tensor  # (L,) long: prompt + generated so far
    prompt_len: int
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.context[self.prompt_len:].tolist()


@dataclass(frozen=True)
class StopRule:
    """When a generation ends: at an EOS token ("eos"), after ``max_new_tokens`` or at the model's
    context limit ``max_length`` ("length"), mid-block if need be."""
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    max_length: int | None = None

    def check(self, prompt: torch.Tensor) -> None:
        """Fail before any pass if nothing could be generated from ``prompt`` (T,) long."""
        if prompt.ndim != 1 or prompt.shape[0] < 1:
            raise ConfigError("the prompt is empty: give at least one token")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_length is not None and prompt.shape[0] >= self.max_length:
            raise ConfigError(f"the prompt has {prompt.shape[0]} tokens but the model's context is "
                              f"{self.max_length}: shorten the prompt")

    def cut(self, new: list[int], state: DecodeState) -> tuple[list[int], str | None]:
        """The part of a step's ``new`` tokens that is kept, and the finish reason if it ends here."""
        budget = self.max_new_tokens - state.stats.new_tokens
        if self.max_length is not None:
            budget = min(budget, self.max_length - state.context.shape[0])
        for i, tok in enumerate(new[:budget]):
            if tok in self.eos_token_ids:
                return new[:i + 1], "eos"
        if len(new) >= budget:
            return new[:budget], "length"
        return new, None


class _Clock:
    """Wall time of the loop's stages, summed into ``Stats``: drafting (propose, observe) in
    ``draft_s``, the target's passes in ``verify_s`` (the prefill also in ``prefill_s``), the whole
    generation so far in ``wall_s``; and the current step's duration, for the pacer."""

    def __init__(self, stats: Stats):
        self.stats = stats
        self.start = self.step_start = time.perf_counter()

    def timed(self, fields: str | tuple[str, ...], fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, its wall time added to the stats' ``fields``."""
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t
        for name in (fields,) if isinstance(fields, str) else fields:
            setattr(self.stats, name, getattr(self.stats, name) + dt)
        return out

    def begin_step(self) -> None:
        self.step_start = time.perf_counter()

    def step_ms(self) -> float:
        return (time.perf_counter() - self.step_start) * 1e3

    def lap(self) -> None:
        self.stats.wall_s = time.perf_counter() - self.start


@dataclass(frozen=True)
class _Verified:
    """A verification pass over a draft tree: ``out.logits`` (N, V') one row per node, and with a
    drafter that needs them ``out.hidden`` (N, H); ``start``: the cache length before the pass."""
    out: ForwardOut
    start: int


def decode(target: Backend, drafter: Drafter, prompt: torch.Tensor, *, max_new_tokens: int,
           sampling: SamplingConfig, eos_token_ids: set[int] = frozenset(), max_length: int | None = None,
           replacement: bool = True, generator: torch.Generator | None = None,
           vocab_size: int | None = None, acceptance: AcceptanceConfig | None = None,
           embedding: torch.Tensor | None = None, pacer: Pacer | None = None) -> Iterator[tuple[DecodeState, Step]]:
    """Yield (state, step) after every step. ``prompt`` (T,) long, T >= 1. ``acceptance``: an
    approximate rule (off by default: None or exact is lossless); ``embedding`` (V, H) for the
    distance rule; ``pacer``: decides step by step whether drafting pays (else the step verifies
    the root alone; ``drafters.pacing``)."""
    stop = StopRule(max_new_tokens, frozenset(eos_token_ids), max_length)
    stop.check(prompt)
    V = vocab_size or target.vocab_size
    state = DecodeState(prompt.clone(), prompt.shape[0])
    if acceptance is not None and not acceptance.exact:
        state.stats.acceptance = acceptance.label
    accept = partial(accept_tree, sampling=sampling, replacement=replacement, generator=generator,
                     acceptance=acceptance, embedding=embedding)
    clock = _Clock(state.stats)
    _prefill(target, drafter, prompt, clock)  # 0. prefill
    while state.finish_reason is None:
        clock.begin_step()
        drafted = pacer is None or pacer.draft_now()
        draft = clock.timed("draft_s", _propose, drafter, state.context, drafted)  # 1. draft
        verified = clock.timed("verify_s", _verify, target, draft, drafter.hidden_need)  # 2. verify
        path, token = accept(draft, verified.out.logits[:, :V])  # 3. accept
        step = _commit(target, drafter, state, draft, verified, path, token, stop, clock)  # 4. commit
        state.stats.plain_steps += not drafted
        if pacer is not None:
            pacer.record(drafted, len(step.tokens), clock.step_ms())
        clock.lap()
        yield state, step


def _prefill(target: Backend, drafter: Drafter, prompt: torch.Tensor, clock: _Clock) -> None:
    """The target caches every prompt token but the last (the first root); the drafter begins,
    with the hidden states it needs of those positions."""
    need = drafter.hidden_need
    target.reset()
    pre = None
    if prompt.shape[0] > 1:
        rows = torch.tensor([prompt.shape[0] - 2]) if need is not HiddenNeed.NONE else torch.empty(0, dtype=torch.long)
        pre = clock.timed(("prefill_s", "verify_s"), target.forward, prompt[:-1], rows=rows, want_hidden=need)
    hidden = None if pre is None or pre.hidden is None else pre.hidden[-1] if need is HiddenNeed.LAST else pre.hidden
    drafter.begin(prompt, hidden=hidden)


def _propose(drafter: Drafter, context: torch.Tensor, drafted: bool) -> Draft:
    """The drafter's tree, or (a step the pacer keeps plain) the root alone."""
    return drafter.propose(context) if drafted else Draft(chain(0), context[-1:])


def _verify(target: Backend, draft: Draft, need: HiddenNeed) -> _Verified:
    """One target pass over the whole tree: positions = cache length + node depth, tree mask."""
    start = target.cache_length
    tree = draft.tree
    want = HiddenNeed.NONE if need is HiddenNeed.NONE else HiddenNeed.LAST  # rows=None: every node's state
    return _Verified(target.forward(draft.tokens.clamp(min=0), start + tree.depths, tree.mask, want_hidden=want), start)


def _commit(target: Backend, drafter: Drafter, state: DecodeState, draft: Draft, verified: _Verified,
            path: list[int], token: int, stop: StopRule, clock: _Clock) -> Step:
    """Keep the accepted path's KV entries (the rest of the tree is dropped), tell the drafter,
    and append the new tokens to the context, cut by the stopping rule."""
    target.compact(verified.start, torch.tensor(path, dtype=torch.long))
    hidden = verified.out.hidden  # (N, H) or None
    if hidden is not None:  # the state at the last accepted node predicts what follows
        hidden = hidden[path[-1]] if drafter.hidden_need is HiddenNeed.LAST else hidden[path]
    clock.timed("draft_s", drafter.observe, path, token, hidden=hidden)
    accepted = draft.tokens[path[1:]].tolist()
    _record(state.stats, draft.tree.depth, len(accepted))
    new, state.finish_reason = stop.cut(accepted + [token], state)
    state.stats.new_tokens += len(new)
    state.context = torch.cat([state.context, torch.tensor(new, dtype=torch.long)])
    n_draft = min(len(accepted), len(new))  # the block may have been cut short
    return Step(new[:n_draft], new[n_draft] if len(new) > n_draft else -1)


def _record(st: Stats, depth: int, n_accepted: int) -> None:
    """Count one verified step that drafted ``depth`` positions and accepted ``n_accepted``."""
    st.target_calls += 1
    while len(st.drafted_by_depth) < depth:
        st.drafted_by_depth.append(0)
        st.accepted_by_depth.append(0)
    for d in range(min(n_accepted + 1, depth)):
        st.drafted_by_depth[d] += 1
    for d in range(n_accepted):
        st.accepted_by_depth[d] += 1
    st.accepted_per_call.append(n_accepted)
    st.drafted_per_call.append(depth)
