"""The scheduler: a bounded queue of jobs and the worker that runs them on one decoder.

Decoding is CPU-bound, so one worker thread runs the decoder; the HTTP side only waits on events.
``submit`` puts a ``Job`` in the queue (or refuses it with ``QueueFull`` when the queue is full)
and returns its ``Ticket``; the worker sends the ticket's events (``Started``, ``Token``, then
``Finished`` or ``Failed``) to the event loop that submitted it.

Continuous batching (``max_batch`` > 1): the worker keeps up to ``max_batch`` generations in one
``batching.Batch``: every step verifies all of their trees in one target pass. Between steps,
queued jobs join (their prefill rides in the next pass) and finished or cancelled ones leave at
once, so a new request never waits for the others to end. With ``max_batch`` 1 the jobs run one
after another. ``Ticket.cancel`` ends its generation before the next step (or skips it if it
has not started). A job that fails is reported and the next one starts clean: every generation
gets a KV cache and a drafter of its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..batching import Batch
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
    """Runs jobs on ``decoder`` (a SpeculativeDecoder), up to ``max_batch`` at once, at most
    ``max_queue`` waiting. ``on_finish(ticket, event)``: called in the worker after every job
    (metrics)."""

    def __init__(self, decoder, max_queue: int, on_finish: Callable[[Ticket, Any], None] | None = None,
                 max_batch: int = 1):
        if max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        self.decoder, self.on_finish, self.max_batch = decoder, on_finish, max_batch
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_queue)
        self._running = 0
        work = self._work if max_batch == 1 else self._work_batched
        self._thread = threading.Thread(target=work, name="speculant-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

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
            self._running = 1
            try:
                event = self._run_one(ticket)
            except Exception as e:  # noqa: BLE001 -- a failed job must not stop the worker
                log.exception("generation failed")
                event = Failed(500, f"the generation failed: {type(e).__name__}: {e}")
            finally:
                self._running = 0
            self._end(ticket, event)

    def _end(self, ticket: Ticket, event) -> None:
        """Send a job's last event and count it."""
        ticket.send(event)
        if self.on_finish is not None:
            try:
                self.on_finish(ticket, event)
            except Exception:  # noqa: BLE001
                log.exception("metrics update failed")

    def _work_batched(self) -> None:
        """The continuous-batching worker (see the module doc)."""
        batch = Batch(self.max_batch, getattr(self.decoder, "batch_pacer", None))
        live: dict[Any, Ticket] = {}  # generation -> its ticket
        closing = False

        def stream(gen, events) -> None:
            for ev in events:
                live[gen].send(Token(ev.token_id, ev.text))

        def failed(gen, error: Exception) -> None:
            log.error("generation failed: %s: %s", type(error).__name__, error)
            message = str(error) if isinstance(error, ConfigError) else \
                f"the generation failed: {type(error).__name__}: {error}"
            self._end(live.pop(gen), Failed(400 if isinstance(error, ConfigError) else 500, message))

        while True:
            while not closing and not batch.full:  # admit: wait for work only when there is none
                try:
                    ticket = self._queue.get(block=not live)
                except queue.Empty:
                    break
                if ticket is None:
                    closing = True
                    break
                if ticket.cancelled:  # its client left while it waited
                    continue
                gen = self._prepare(ticket)
                if isinstance(gen, Failed):
                    self._end(ticket, gen)
                    continue
                live[gen] = ticket
                try:
                    self.decoder.join(batch, gen, on_events=stream, on_error=failed)
                except ConfigError as e:
                    del live[gen]
                    self._end(ticket, Failed(400, str(e)))
                except Exception as e:  # noqa: BLE001
                    log.exception("generation failed")
                    del live[gen]
                    self._end(ticket, Failed(500, f"the generation failed: {type(e).__name__}: {e}"))
            for gen, ticket in list(live.items()):  # cancelled requests leave at once
                if ticket.cancelled and gen.finish_reason is None:
                    self.decoder.leave(batch, gen)
            self._running = len(batch)
            if len(batch):
                try:
                    with torch.inference_mode():
                        batch.step()
                except Exception as e:  # noqa: BLE001 -- the step's sequences fail, the worker goes on
                    log.exception("generation failed")
                    status = 400 if isinstance(e, ConfigError) else 500
                    for gen in list(live):
                        if gen.finish_reason is None:
                            self.decoder.leave(batch, gen)
                            self._end(live.pop(gen), Failed(status, f"the generation failed: {type(e).__name__}: {e}"))
            for gen, ticket in list(live.items()):  # finished (or cancelled) sequences report
                if gen.finish_reason is not None:
                    del live[gen]
                    self._end(ticket, Finished(list(gen.token_ids), gen.text, gen.finish_reason, gen.stats))
            self._running = len(batch)
            if closing and not live:
                return

    def _prepare(self, ticket: Ticket):
        """The job's Generation, checked against the context (Started sent), or Failed(400)."""
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
        return gen

    def _run_one(self, ticket: Ticket):
        """Run one job, sending its tokens; returns its last event (Finished or Failed)."""
        gen = self._prepare(ticket)
        if isinstance(gen, Failed):
            return gen
        try:
            for ev in gen:
                ticket.send(Token(ev.token_id, ev.text))
        except ConfigError as e:
            return Failed(400, str(e))
        return Finished(list(gen.token_ids), gen.text, gen.finish_reason, gen.stats)
