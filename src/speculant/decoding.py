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

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .acceptance import accept_tree
from .backends.base import Backend, ForwardOut, ForwardRequest
from .config import AcceptanceConfig, SamplingConfig
from .drafters.base import Drafter, HiddenNeed, PassPlan
from .tuning.pacing import Pacer
from .errors import ConfigError, ModelLoadError
from .penalties import penalise
from .trees.buffers import chain
from .trees.draft import Draft, first_nodes, within_depth

if TYPE_CHECKING:
    from .constraints import Constraint
    from .runtime.prefix_cache import PrefixCache

__all__ = ["DecodeState", "SequenceRun", "Stats", "Step", "StopRule", "TokenLogprob", "decode", "token_logprobs"]


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
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache (not prefilled)
    wall_s: float = 0.0
    plain_steps: int = 0  # steps verified as the root alone because drafting did not pay (drafters.pacing)
    acceptance: str = "exact"  # the rule that ran; anything but "exact" may change the output
    prediction_accepted: int = 0  # draft tokens from the request's prediction that the target accepted
    prediction_rejected: int = 0  # draft tokens from the prediction the target verified and refused
    verified_rows: int = 0  # tree rows the target verified over all steps (the root included)

    @property
    def rows_per_call(self) -> float:
        return self.verified_rows / self.target_calls if self.target_calls else 0.0

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
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "other_s": max(self.wall_s - self.draft_s - self.verify_s, 0.0),
            "wall_s": self.wall_s,
            "plain_steps": self.plain_steps,
            "prediction_accepted": self.prediction_accepted,
            "prediction_rejected": self.prediction_rejected,
            "verified_rows": self.verified_rows,
            "rows_per_call": self.rows_per_call,
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else 0.0,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """The target model's log-probability of a committed token at its position (log-softmax of
    its raw logits: before penalties, temperature and filtering, the same under any method), and
    the ``top`` most likely tokens there as (token id, log-probability), most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Step:
    """What one step committed: accepted draft tokens, then the target's token (-1 when the
    block was cut at EOS or at max_new_tokens before it); with ``logprobs`` asked for, one
    :class:`TokenLogprob` per token of :attr:`tokens`."""
    accepted: list[int]
    target_token: int
    logprobs: tuple[TokenLogprob, ...] = ()

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


class SequenceRun:
    """One generation's decoding loop, stage by stage, so that a caller can run the target's
    passes itself (``batching`` verifies several sequences in one pass):

        run = SequenceRun(target, drafter, prompt, ...)
        run.begin(target.forward(*run.prefill()) if run.prefill() else None)   # 0. prefill
        while run.finish_reason is None:
            draft = drive(run.draft_plan())                                     # 1. draft
            out = target.forward(...run.verify_request(draft)...)               # 2. verify
            step = run.complete(draft, out, pass_seconds)                       # 3. accept, 4. commit

    ``batching.Batch.step`` runs this loop for one or several sequences (``decode``: a batch of
    one). The target backend is the sequence's own (its KV cache); ``complete`` compacts it.
    Arguments as ``decode``'s, and ``prefix_cache`` (``runtime.prefix_cache``; a native target
    only): the prefill starts from the longest cached prefix of the prompt, and the prompt's
    entries (after the prefill) and the whole context's (when the run ends: ``remember``) are
    kept there, with the target states an ``HiddenNeed.ALL`` drafter needs. ``fast_prefill``
    False: the prompt runs on the decoding kernels, not the runtime's prefill kernels, so that
    its cached entries are the bits any later request computes for them."""

    def __init__(self, target: Backend, drafter: Drafter, prompt: torch.Tensor, *, max_new_tokens: int,
                 sampling: SamplingConfig, eos_token_ids: set[int] = frozenset(), max_length: int | None = None,
                 replacement: bool = True, generator: torch.Generator | None = None,
                 vocab_size: int | None = None, acceptance: AcceptanceConfig | None = None,
                 embedding: torch.Tensor | None = None, pacer: Pacer | None = None,
                 logprobs: int | None = None, constraint: Constraint | None = None,
                 max_draft_depth: int | None = None, prefix_cache: "PrefixCache | None" = None,
                 fast_prefill: bool = True):
        self.stop = StopRule(max_new_tokens, frozenset(eos_token_ids), max_length)
        self.max_draft_depth = max_draft_depth  # None: the drafter's own; 0: the root alone (plain decoding)
        self.penalties = sampling.penalties if sampling.penalties.active else None
        self.logprobs = logprobs  # None: off; k >= 0: each token's log-probability and the top k
        self.constraint = constraint  # None: free text; else the grammar state (``constraints``)
        if constraint is not None and acceptance is not None and not acceptance.exact:
            raise ConfigError(f"response_format needs the exact acceptance rule: {acceptance.label} may accept tokens "
                              "the grammar forbids")
        self.stop.check(prompt)
        self.target, self.drafter, self.pacer, self.prompt = target, drafter, pacer, prompt
        self.V = vocab_size or target.vocab_size
        self.state = DecodeState(prompt.clone(), prompt.shape[0])
        if acceptance is not None and not acceptance.exact:
            self.state.stats.acceptance = acceptance.label
        self.accept = partial(accept_tree, sampling=sampling, replacement=replacement, generator=generator,
                              acceptance=acceptance, embedding=embedding)
        self.clock = _Clock(self.state.stats)
        self._drafted = True
        self._paced_here = True
        self._start = 0
        self.prefix_cache = prefix_cache
        self.fast_prefill = fast_prefill  # False: the prompt on the decoding kernels (ForwardRequest.prefill off)
        self._cached_features: torch.Tensor | None = None  # a hit's (n, W), until begin
        self._begun = False  # the prefill's output reached begin: the target's cache is this run's
        self.state.stats.prompt_tokens = prompt.shape[0]
        # the target states at every cached position (n, W), kept for the prefix cache: an ALL drafter's
        self._features: list[torch.Tensor] | None = \
            [] if prefix_cache is not None and self.drafter.hidden_need is HiddenNeed.ALL else None

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    def prefill(self) -> ForwardRequest | None:
        """The prefill pass: every prompt token but the last (the first root), with the hidden
        states the drafter needs; None for a one-token prompt. Resets the target's cache. With a
        prefix cache, the cached whole blocks of ``prompt[:-1]`` are copied into the target's
        cache first and the pass covers the rest (at least one token: the state of position
        T-2 and the drafter's start come from a real pass)."""
        self.target.reset()
        T = self.prompt.shape[0]
        if T < 2:
            return None
        need = self.drafter.hidden_need
        done, self._cached_features = 0, None
        if self.prefix_cache is not None:
            hit = self.prefix_cache.match(self.prompt[:-1], limit=T - 2, features=need is HiddenNeed.ALL)
            if hit.tokens:
                self.prefix_cache.restore(hit, self.target.cache)
                self._cached_features = hit.features()
            done = hit.tokens
        self.state.stats.cached_tokens = done
        rows = torch.tensor([T - 2 - done]) if need is not HiddenNeed.NONE else torch.empty(0, dtype=torch.long)
        return ForwardRequest(self.prompt[done:-1], rows=rows, want_hidden=need, layers=self.drafter.hidden_layers,
                              prefill=self.fast_prefill)

    def begin(self, out: ForwardOut | None, seconds: float = 0.0) -> None:
        """The prefill pass's output (None without one) took ``seconds``: start the drafter."""
        st = self.state.stats
        st.prefill_s += seconds
        st.verify_s += seconds
        need = self.drafter.hidden_need
        hidden = (None if out is None or out.hidden is None
                  else out.hidden[-1] if need is HiddenNeed.LAST else out.hidden)
        cached = self._cached_features
        if cached is not None and hidden is not None:  # (cached, W) then the pass's (n, W): (T-1, W)
            hidden = torch.cat([cached.to(hidden.dtype), hidden])
        self._cached_features = None
        self.drafter.begin(self.prompt, hidden=hidden)
        self._begun = True
        if self._features is not None and hidden is not None:
            self._features.append(hidden)
        self.remember()  # the prompt's blocks: the next turn, and other members with this prompt, start there
        self.clock.lap()

    def remember(self) -> int:
        """Keep the context's KV entries (whole blocks) in the prefix cache, with the target
        states an ALL drafter needs; returns the tokens cached for this context (0 without a
        cache). Safe between steps only: the cache holds the committed context's entries there."""
        pc = self.prefix_cache
        if pc is None or not self._begun:
            return 0
        feats = None
        if self._features is not None:
            if not self._features:
                return 0
            if len(self._features) > 1:
                self._features[:] = [torch.cat(self._features)]
            feats = self._features[0]
        return pc.insert(self.state.context, self.target.cache, features=feats)

    def draft_plan(self, drafting: bool | None = None) -> PassPlan:
        """Stage 1 as a PassPlan (``drafters.base``): the drafter's jobs (a draft model's passes,
        the heads' calls), if it offers them, are yielded for the caller to run (``batching`` runs
        several sequences' together). ``drafting``: the caller's choice between drafting and the
        root alone for this step (a batch paces all its members at once), in place of this run's
        own pacer (which then does not count the step); None: the pacer's choice. Without a
        pacer (pacing off) every step drafts. ``max_draft_depth`` (the run's) cuts the draft to
        that depth; 0 verifies the root alone at every step. Under a grammar the draft is cut
        before its first node the grammar refuses (breadth-first: a chain at its first refused
        token), so no row is verified that could not be accepted."""
        self.clock.begin_step()
        self._paced_here = drafting is None and self.max_draft_depth != 0
        if self.max_draft_depth == 0:
            self._drafted = False
        elif self.pacer is None:
            self._drafted = True
        else:
            self._drafted = self.pacer.draft_now() if drafting is None else drafting
        context = self.state.context
        if not self._drafted:  # the root alone
            return self.clock.timed("draft_s", _root_alone, context)
        t = time.perf_counter()
        draft = yield from self.drafter.propose_passes(context)
        if self.max_draft_depth is not None:
            draft = within_depth(draft, self.max_draft_depth)
        if self.constraint is not None:  # cut where the grammar refuses: those rows could never be accepted
            draft = first_nodes(draft, self.constraint.allowed_prefix(draft.tree, draft.tokens))
        self.state.stats.draft_s += time.perf_counter() - t
        return draft

    def verify_request(self, draft: Draft) -> ForwardRequest:
        """Stage 2: one target pass over the whole tree (positions = cache length + node depth,
        the tree mask; every node's hidden state if the drafter needs them)."""
        self._start = self.target.cache_length
        tree = draft.tree
        want = HiddenNeed.NONE if self.drafter.hidden_need is HiddenNeed.NONE else HiddenNeed.LAST
        return ForwardRequest(draft.tokens.clamp(min=0), self._start + tree.depths, tree.mask, want_hidden=want,
                              layers=self.drafter.hidden_layers)

    def complete(self, draft: Draft, out: ForwardOut, seconds: float) -> Step:
        """Stages 3 and 4: accept from the verification pass's output ``out`` (which took
        ``seconds``) and commit; returns the step (the state is in ``self.state``)."""
        self.state.stats.verify_s += seconds
        raw = out.logits[:, :self.V]
        _check_finite(raw, self.target.name, self.state.stats.new_tokens)
        logits = raw if self.penalties is None else penalise(raw, self.penalties, self.state.context,
                                                             self.state.prompt_len, draft.tree, draft.tokens)
        if self.constraint is not None:  # every node's row masked by the grammar after its own path
            logits = self.constraint.mask_tree(logits, draft.tree, draft.tokens)
        path, token = self.accept(draft, logits)
        k = getattr(self.drafter, "topk_need", 0)
        if k:  # the target's top-k after every verified node, for a drafter that learns from them
            valid = draft.tokens >= 0
            top = raw[valid].topk(min(k, raw.shape[-1]), dim=-1).indices  # (n, k)
            self.clock.timed("draft_s", self.drafter.observe_pass, draft.tokens[valid], top)
        step = _commit(self.target, self.drafter, self.state, draft, _Verified(out, self._start), path, token,
                       self.stop, self.clock, self.constraint)
        if self._features is not None and out.hidden is not None:  # the accepted nodes' states (len(path), W)
            self._features.append(out.hidden[path])
        if self.state.finish_reason is not None:
            self.remember()  # the answer too: the next turn sends it back
            finish = getattr(self.drafter, "finish", None)
            if finish is not None:  # a drafter that keeps what was answered (drafters.suffix)
                finish(self.state.context)
        if self.logprobs is not None:
            step = dataclasses.replace(step, logprobs=token_logprobs(raw, path, step.tokens, self.logprobs))
        self.state.stats.plain_steps += not self._drafted
        if self.pacer is not None and self._paced_here:
            self.pacer.record(self._drafted, len(step.tokens), self.clock.step_ms())
        self.clock.lap()
        return step


def token_logprobs(logits: torch.Tensor, path: list[int], tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each committed token's :class:`TokenLogprob`: token j (of ``tokens``, the step's) was
    chosen at node ``path[j]``, whose row of ``logits`` (N, V) is the target's distribution there."""
    if not tokens:
        return ()
    logp = logits[torch.tensor(path[:len(tokens)])].float().log_softmax(-1)  # (n, V)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top <= 0:
        return tuple(TokenLogprob(c) for c in chosen)
    val, idx = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return tuple(TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, idx.tolist(), val.tolist()))


def decode(target: Backend, drafter: Drafter, prompt: torch.Tensor, **options) -> Iterator[tuple[DecodeState, Step]]:
    """Yield (state, step) after every step. ``prompt`` (T,) long, T >= 1. Keywords
    (``SequenceRun``'s): max_new_tokens, sampling, eos_token_ids, max_length, replacement,
    generator, vocab_size; ``acceptance``: an approximate rule (off by default: None or exact is
    lossless); ``embedding`` (V, H) for the distance rule; ``pacer``: decides step by step whether
    drafting pays (else the step verifies the root alone; ``tuning.pacing``); ``logprobs``: k to
    report each token's log-probability and the top k; ``constraint``: a grammar the output must
    match (``constraints.Constraint``: every verified row masked, exact for the masked target);
    ``max_draft_depth``: drafts cut to that depth (0: plain decoding).

    One driver runs every generation: this is a ``batching.Batch`` of one sequence (``run_alone``)."""
    from .batching import run_alone  # batching builds on SequenceRun

    yield from run_alone(SequenceRun(target, drafter, prompt, **options))


@dataclass(frozen=True)
class _Verified:
    """A verification pass over a draft tree: ``out.logits`` (N, V') one row per node, and with a
    drafter that needs them ``out.hidden`` (N, H); ``start``: the cache length before the pass."""
    out: ForwardOut
    start: int


def _check_finite(logits: torch.Tensor, name: str, done: int) -> None:
    """A broken model's logits (NaN, +inf, or a row of -inf) would be decoded as if they meant
    something (argmax of NaN, a sample from nothing): stop with what went wrong instead (``name``:
    the target backend's)."""
    # the usual case: one sum (NaN and inf carry through it; a sum that overflows only sends
    # finite logits to the exact check below); isfinite(logits).all() costs ~1 ms at 4 rows of
    # 152k logits, the sum 0.03 ms
    if bool(logits.sum(dtype=torch.float32).isfinite()):
        return
    if bool(torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all(-1).any()):
        raise ModelLoadError(
            f"the target model ({name}) produced non-finite logits (NaN or inf) after "
            f"{done} generated tokens: its weights are broken or its activations overflow; check the model file, "
            "or try --dtype float32")


def _root_alone(context: torch.Tensor) -> Draft:
    """A step the pacer keeps plain: the root alone."""
    return Draft(chain(0), context[-1:])


def _commit(target: Backend, drafter: Drafter, state: DecodeState, draft: Draft, verified: _Verified,
            path: list[int], token: int, stop: StopRule, clock: _Clock, constraint: Constraint | None = None) -> Step:
    """Keep the accepted path's KV entries (the rest of the tree is dropped), tell the drafter,
    and append the new tokens to the context, cut by the stopping rule (and where a grammar
    ``constraint`` ends: its committed state advances by them)."""
    target.compact(verified.start, torch.tensor(path, dtype=torch.long))
    hidden = verified.out.hidden  # (N, H) or None
    if hidden is not None:  # the state at the last accepted node predicts what follows
        hidden = hidden[path[-1]] if drafter.hidden_need is HiddenNeed.LAST else hidden[path]
    clock.timed("draft_s", drafter.observe, path, token, hidden=hidden)
    accepted = draft.tokens[path[1:]].tolist()
    _record(state.stats, draft.tree.depth, len(accepted))
    state.stats.verified_rows += draft.tree.size
    new, state.finish_reason = stop.cut(accepted + [token], state)
    if constraint is not None:
        new, state.finish_reason = constraint.commit(new, state.finish_reason)
    state.stats.new_tokens += len(new)
    state.context = torch.cat([state.context, torch.tensor(new, dtype=torch.long)])
    n_draft = min(len(accepted), len(new))  # the block may have been cut short
    if draft.predicted is not None:  # nodes from the request's prediction: accepted, or verified and refused
        on_path = draft.predicted[path[1:]]
        state.stats.prediction_accepted += int(on_path[:n_draft].sum())
        state.stats.prediction_rejected += int(draft.predicted.sum()) - int(on_path.sum())
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
