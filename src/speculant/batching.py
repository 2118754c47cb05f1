"""Batched speculative decoding: several sequences advance together, one target pass per step.

Each member of a :class:`Batch` is one generation's :class:`~speculant.decoding.SequenceRun`
over its own target backend (a ``sibling``: its own KV cache, the same weights), with its own
drafter, sampling generator, pacer and stopping rule. One :meth:`Batch.step`:

    1. draft    every running member proposes its tree (trees may differ in size); the drafters'
                work (a draft model's passes, the heads' calls: ``drafters.base.Job``) runs as
                one call per kind and depth for all members;
    2. verify   ONE target pass (``backends.base.forward_batch``) scores every member's tree, and
                the prompts of members that joined since the last step (their prefill);
    3. accept   each member walks its own tree with its own acceptance rule;
    4. commit   each member compacts its own cache and extends its own context.

Members join between steps (``add``) and leave as soon as they finish or are cancelled
(``step`` drops them; ``remove`` drops one at once). The native runtime concatenates the rows of
all members through every linear layer — one read of the weights for all of them — and each
member's rows attend to its own cache under its own mask, so no member is padded to another's
tree and each gets bit for bit what it would get decoded alone. The transformers runtime verifies
the members one after another (same results, no shared pass).

Pacing across the batch: alone, a sequence's pacer (``tuning.pacing``) drafts only while its
drafting steps yield more tokens per millisecond than its plain ones. In a batch one member's
extra rows and drafting time slow every member's step, so while several members step together
(and all pace) the batch's own :class:`~speculant.tuning.pacing.Pacer` makes that choice for
all of them, on the whole batch's tokens per millisecond of step (steps carrying a prefill are not
counted).

Tree sizing across the batch: a member's sizer (``tuning.sizing.TreeSizer``) is told how many
rows the other members put in the pass and how many tokens they are expected to yield, and sizes
its own tree for the most tokens per millisecond of the whole pass: the more members, the more
each extra row costs them all, the smaller each tree (never less than the root).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from .backends.base import Backend, ForwardRequest, forward_batch
from .decoding import DecodeState, SequenceRun, Step
from .drafters.base import Job, PassPlan
from .trees.draft import Draft
from .tuning.pacing import Pacer

__all__ = ["Batch", "Member", "run_alone"]


@dataclass
class Member:
    """One sequence of a batch. ``key``: the caller's handle; ``on_step(member, step)`` is called
    after each of its steps and returns True when the member is done (a stop string, a
    cancellation); a member whose run finished (EOS, length) leaves too."""
    key: Hashable
    run: SequenceRun
    on_step: Callable[["Member", Step], bool] | None = None
    on_error: Callable[["Member", Exception], None] | None = None  # it failed (and left); the others go on
    prefilled: bool = False
    done: bool = False
    last_rows: int = 1  # rows of its last verified tree (the root included)
    tokens_per_step: float = 1.0  # moving average of the tokens a step yields
    extra: Any = field(default=None, repr=False)


class Batch:
    """The sequences decoding together (see the module doc). Not thread-safe: one thread adds,
    steps and removes."""

    def __init__(self, max_size: int | None = None, pacer: Pacer | None = None):
        self.max_size = max_size
        self.pacer = pacer if pacer is not None else Pacer()  # the choice to draft while members step together
        self.members: list[Member] = []
        self.passes = 0  # target passes run
        self.rows = 0  # rows verified in them

    def __len__(self) -> int:
        return len(self.members)

    @property
    def full(self) -> bool:
        return self.max_size is not None and len(self.members) >= self.max_size

    def add(self, key: Hashable, run: SequenceRun, on_step: Callable[[Member, Step], bool] | None = None,
            on_error: Callable[[Member, Exception], None] | None = None) -> Member:
        """Join ``run`` (a fresh SequenceRun on a target backend no other member uses); its
        prefill runs in the next step's pass. An exception in a member's own work (drafting,
        accepting, committing, ``on_step``) ends that member alone, through ``on_error``; one in
        the shared pass propagates from ``step`` (no member can go on from it)."""
        if self.full:
            raise RuntimeError(f"the batch is full ({self.max_size} sequences)")
        if any(m.run.target is run.target for m in self.members):
            raise ValueError("every member needs its own target backend (KV cache): use backend.sibling()")
        member = Member(key, run, on_step, on_error)
        self.members.append(member)
        return member

    def remove(self, key: Hashable) -> Member | None:
        """Drop the member ``key`` now (a cancelled request); returns it, or None."""
        for i, m in enumerate(self.members):
            if m.key == key:
                return self.members.pop(i)
        return None

    def step(self) -> list[tuple[Member, Step]]:
        """One step of every member (see the module doc): returns (member, step) for each member
        that verified a tree in this pass (members that only prefilled return nothing yet).
        Finished members are dropped after their last step."""
        if not self.members:
            return []
        t0 = time.perf_counter()
        backends: list[Backend] = []
        requests: list[ForwardRequest] = []
        work: list[tuple[Member, Draft | None]] = []
        prefills: dict[int, ForwardRequest] = {}  # the joiners' prompts, verified in this pass
        for m in self.members:
            if not m.prefilled:
                request = m.run.prefill()
                if request is None:  # nothing to prefill (a one-token prompt): it drafts at once
                    m.run.begin(None)
                    m.prefilled = True
                else:
                    prefills[id(m)] = request
        stepping = [m for m in self.members if m.prefilled]
        self._share_budget(stepping)
        drafting = None  # None: each member's own pacer decides (alone, or a member that does not pace)
        if len(stepping) > 1 and all(m.run.pacer is not None for m in stepping):
            drafting = self.pacer.draft_now()
        plans = {}
        for m in stepping:
            try:
                plans[id(m)] = m.run.draft_plan(drafting)
            except Exception as e:  # noqa: BLE001 -- one member's fault
                self._fail(m, e)
        drafts, errors = _run_plans(plans)  # 1. draft (draft-model passes shared)
        for m in stepping:
            if id(m) in errors:
                self._fail(m, errors[id(m)])
        for m in self.members:
            if m.done:
                continue
            if not m.prefilled:
                backends.append(m.run.target)
                requests.append(prefills[id(m)])
                work.append((m, None))
                continue
            draft = drafts[id(m)]
            backends.append(m.run.target)
            requests.append(m.run.verify_request(draft))
            work.append((m, draft))
        t = time.perf_counter()
        outs = forward_batch(backends, requests)
        seconds = time.perf_counter() - t
        self.passes += 1
        self.rows += sum(int(r.tokens.shape[0]) for r in requests)
        stepped = []
        for (m, draft), out in zip(work, outs):
            if draft is None:
                m.run.begin(out, seconds)
                m.prefilled = True
                continue
            try:
                step = m.run.complete(draft, out, seconds)
                m.last_rows = int(draft.tokens.shape[0])
                m.tokens_per_step = 0.8 * m.tokens_per_step + 0.2 * len(step.tokens)
                stepped.append((m, step))
                if m.on_step is not None and m.on_step(m, step):
                    m.done = True
            except Exception as e:  # noqa: BLE001 -- one member's fault
                self._fail(m, e)
            if m.run.finish_reason is not None:
                m.done = True
        if drafting is not None and all(draft is not None for _, draft in work):
            self.pacer.record(drafting, sum(len(step.tokens) for _, step in stepped), (time.perf_counter() - t0) * 1e3)
        self.members = [m for m in self.members if not m.done]
        return stepped

    def _fail(self, m: Member, error: Exception) -> None:
        """End member ``m`` after a fault of its own; ``on_error`` tells its owner."""
        m.done = True
        if m.on_error is None:
            raise error
        m.on_error(m, error)

    def _share_budget(self, stepping: list[Member]) -> None:
        """Tell each member's tree sizer what the others put into the pass (see the module doc)."""
        total_rows = sum(m.last_rows for m in stepping)
        total_tokens = sum(m.tokens_per_step for m in stepping)
        for m in stepping:
            sizer = m.run.drafter.sizer
            if sizer is not None:
                sizer.share(total_rows - m.last_rows, total_tokens - m.tokens_per_step)


def run_alone(run: SequenceRun) -> Iterator[tuple[DecodeState, Step]]:
    """Drive ``run`` as a batch of one: (state, step) after every step, until it finishes (the
    driver of a single generation: ``decoding.decode``, ``SpeculativeDecoder.steps``)."""
    batch = Batch(1)
    batch.add(run, run)
    while len(batch):
        for _, step in batch.step():
            yield run.state, step


def _run_plans(plans: dict[Hashable, PassPlan]) -> tuple[dict[Hashable, Draft], dict[Hashable, Exception]]:
    """Run several drafters' PassPlans together: each round, the pending jobs of every plan that
    has one, those with equal ``together`` keys as one call (``Job.run_together``: one
    ``forward_batch`` for the draft model's passes, one call of the heads for their drafts).
    Returns each plan's Draft, and the exception of each plan that raised one (a failed joint
    call fails every plan in it)."""
    done: dict[Hashable, Draft] = {}
    errors: dict[Hashable, Exception] = {}
    pending: dict[Hashable, tuple[PassPlan, Job]] = {}

    def advance(key, plan, out=None) -> None:
        try:
            pending[key] = (plan, next(plan) if out is None else plan.send(out))
        except StopIteration as stop:
            done[key] = stop.value
            pending.pop(key, None)
        except Exception as e:  # noqa: BLE001 -- that plan's sequence fails alone
            errors[key] = e
            pending.pop(key, None)

    for key, plan in plans.items():
        advance(key, plan)
    while pending:
        groups: dict[Hashable, list[Hashable]] = {}
        for k, (_, job) in pending.items():
            groups.setdefault(job.together, []).append(k)
        for keys in groups.values():
            jobs = [pending[k][1] for k in keys]
            try:
                outs = type(jobs[0]).run_together(jobs)
            except Exception as e:  # noqa: BLE001 -- the plans of this call fail, the others go on
                for k in keys:
                    errors[k] = e
                    pending.pop(k)
                continue
            for k, out in zip(keys, outs):
                advance(k, pending[k][0], out)
    return done, errors
