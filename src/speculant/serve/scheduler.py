"""The scheduler: a bounded queue of jobs and the worker that runs them on one decoder.

Decoding is CPU-bound and a decoder holds one KV cache, so one worker thread runs one generation
at a time; the HTTP side only waits on events. ``submit`` puts a ``Job`` in the queue (or refuses
it with ``QueueFull`` when the queue is full) and returns its ``Ticket``; the worker sends the
ticket's events (``Started``, ``Token``, then ``Finished`` or ``Failed``) to the event loop that
submitted it. ``Ticket.cancel`` ends its generation within one decoding step (or skips it if it
has not started). A job that fails is reported and the next one starts clean: every generation
resets the target's KV cache and gets a fresh drafter.

The worker is the one place that decides which jobs run together: a batched worker that takes
several queued jobs into one target pass replaces ``_run_one`` and keeps the queue, tickets and
events as they are.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError

log = logging.getLogger("speculant.serve")


@dataclass(frozen=True)
class Job:
    """What to generate: ``prompt`` (text or chat messages) and the decoding options."""
    prompt: Any
    max_tokens: int | None  # None: up to the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str


@dataclass(frozen=True)
class Finished:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: Any  # decoding.Stats


@dataclass(frozen=True)
class Failed:
    status: int  # 400: the request cannot be served as asked; 500: the server failed
    message: str


class QueueFull(Exception):
    pass


class Ticket:
    """A submitted job: its events arrive in ``events`` (an asyncio queue of the submitting loop)."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job, self.loop = job, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = 0  # set when the job starts
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def send(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Scheduler:
    """Runs jobs on ``decoder`` (a SpeculativeDecoder) one at a time, at most ``max_queue`` waiting.
    ``on_finish(ticket, event)``: called in the worker after every job (metrics)."""

    def __init__(self, decoder, max_queue: int, on_finish: Callable[[Ticket, Any], None] | None = None):
        if max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {max_queue}")
        self.decoder, self.on_finish = decoder, on_finish
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_queue)
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._work, name="speculant-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return int(self._busy.is_set())

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Ticket:
        ticket = Ticket(job, loop)
        try:
            self._queue.put_nowait(ticket)
        except queue.Full:
            raise QueueFull from None
        return ticket

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs, then stop the worker (waits at most ``timeout`` s)."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if ticket.cancelled:  # its client left while it waited
                continue
            self._busy.set()
            try:
                event = self._run_one(ticket)
            except Exception as e:  # noqa: BLE001 -- a failed job must not stop the worker
                log.exception("generation failed")
                event = Failed(500, f"the generation failed: {type(e).__name__}: {e}")
            finally:
                self._busy.clear()
            ticket.send(event)
            if self.on_finish is not None:
                try:
                    self.on_finish(ticket, event)
                except Exception:  # noqa: BLE001
                    log.exception("metrics update failed")

    def _run_one(self, ticket: Ticket):
        """Run one job, sending its tokens; returns its last event (Finished or Failed)."""
        job, dec = ticket.job, self.decoder
        try:
            gen = dec.start(job.prompt, job.max_tokens or 1, temperature=job.temperature, top_k=job.top_k,
                            top_p=job.top_p, seed=job.seed, stop=list(job.stop), cancel=lambda: ticket.cancelled)
        except ConfigError as e:
            return Failed(400, str(e))
        context = dec.max_length
        if context is not None and gen.prompt_tokens >= context:
            return Failed(400, f"the prompt has {gen.prompt_tokens} tokens but the model's context is {context} "
                               "tokens: shorten the prompt")
        if job.max_tokens is None:
            gen.max_new_tokens = (context - gen.prompt_tokens) if context is not None else 4096
        elif context is not None and gen.prompt_tokens + job.max_tokens > context:
            return Failed(400, f"the prompt has {gen.prompt_tokens} tokens and max_tokens is {job.max_tokens}, "
                               f"{gen.prompt_tokens + job.max_tokens} in all, but the model's context is {context} "
                               f"tokens: ask for at most {context - gen.prompt_tokens} tokens or shorten the prompt")
        ticket.prompt_tokens = gen.prompt_tokens
        ticket.send(Started(gen.prompt_tokens))
        try:
            for ev in gen:
                ticket.send(Token(ev.token_id, ev.text))
        except ConfigError as e:
            return Failed(400, str(e))
        return Finished(list(gen.token_ids), gen.text, gen.finish_reason, gen.stats)
