"""The scheduler: a bounded queue of jobs and the worker that runs them on one decoder.

Decoding is CPU-bound, so one worker thread runs the decoder; the HTTP side only waits on events.
``submit`` puts a ``Job`` in the queue (or refuses it with ``QueueFull`` when the queue is full)
and returns its ``Ticket``; the worker sends the ticket's events (``Started``, ``Token``, then
``Finished`` or ``Failed``) to the event loop that submitted it.

Continuous batching (``max_batch`` > 1): the worker keeps up to ``max_batch`` generations in one
``batching.Batch``: every step verifies all of their trees in one target pass. Between steps,
queued jobs join (their prefill rides in the next pass) and finished or cancelled ones leave at
once, so a new request never waits for the others to end. With ``max_batch`` 1 the jobs run one
after another, on the same path (a batch of one). ``Ticket.cancel`` ends its generation before
the next step (or skips it if it has not started). A job that fails is reported and the next one
starts clean: every generation gets a KV cache and a drafter of its own.

Whatever one job's preparation or decoding raises ends that job alone (``Failed``: 400 for input
it cannot take, 500 otherwise) and the worker goes on. Should the worker itself stop (a fault
outside any job's own handling), ``fatal`` says why, every job still open gets ``Failed(500)``,
``submit`` refuses new ones (``WorkerStopped``) and ``on_fatal(reason)`` is called, so that the
server can report it and exit rather than hang.
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
from ..decoding import Stats
from ..errors import ConfigError
from ..text_check import text_problem

log = logging.getLogger("speculant.serve")


@dataclass(frozen=True)
class Job:
    """What to generate: ``prompt`` (text or chat messages) and the decoding options (those of
    ``SpeculativeDecoder.start``)."""
    prompt: Any
    max_tokens: int | None  # None: up to the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k (Token.logprob)
    response_format: dict | None = None  # SpeculativeDecoder.start's (a grammar the output must match)
    max_draft_depth: int | None = None  # SpeculativeDecoder.start's (0: plain decoding)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's too (Started.prompt_logprobs)
    prediction: str | None = None  # SpeculativeDecoder.start's (text the output is expected to be)
    end_tokens: tuple[int, ...] = ()  # SpeculativeDecoder.start's (token ids that end it, beside the model's)
    cache_prompt: bool = True  # SpeculativeDecoder.start's (False: the prefix cache neither read nor written)


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    prompt_ids: tuple[int, ...] = ()  # with Job.prompt_logprobs: the prompt's token ids
    prompt_logprobs: tuple = ()  # and each one's decoding.TokenLogprob (None for the first)


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str  # the new text this token completes ("" while text is held back)
    logprob: Any = None  # decoding.TokenLogprob, when the job asked for logprobs
    source: str = "target"  # "draft": an accepted draft token; "target": the target's own


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
    param: str | None = None  # the request field at fault, if one is


class QueueFull(Exception):
    pass


class WorkerStopped(Exception):
    """The worker has stopped (the message says why): no job can run any more."""


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
    (metrics). ``on_fatal(reason)``: called once if the worker stops for good."""

    def __init__(self, decoder, max_queue: int, on_finish: Callable[[Ticket, Any], None] | None = None,
                 max_batch: int = 1, on_fatal: Callable[[str], None] | None = None):
        if max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        self.decoder, self.on_finish, self.on_fatal, self.max_batch = decoder, on_finish, on_fatal, max_batch
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_queue)
        self._running = 0
        self.fatal: str | None = None  # why the worker stopped, if it did
        self._closed = False
        self._open: set[Ticket] = set()  # submitted, not yet ended
        self._lock = threading.Lock()  # guards _open and fatal
        self._thread = threading.Thread(target=self._guard, args=(self._work,), name="speculant-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

    @property
    def problem(self) -> str | None:
        """Why no job can run (None: the worker is running)."""
        if self.fatal is not None:
            return self.fatal
        if not self._closed and not self._thread.is_alive():
            return "the decoding worker thread has ended"
        return None

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Ticket:
        ticket = Ticket(job, loop)
        with self._lock:
            if self.fatal is not None:
                raise WorkerStopped(self.fatal)
            try:
                self._queue.put_nowait(ticket)
            except queue.Full:
                raise QueueFull from None
            self._open.add(ticket)
        return ticket

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs, then stop the worker (waits at most ``timeout`` s)."""
        self._closed = True
        if self.fatal is not None or not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _guard(self, work: Callable[[], None]) -> None:
        """Run the worker loop; if anything escapes it, stop for good and say so (module doc)."""
        try:
            work()
        except BaseException as e:  # nothing may end the worker unreported
            reason = f"{type(e).__name__}: {e}"
            log.critical("the decoding worker stopped: %s", reason, exc_info=True)
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        with self._lock:
            self.fatal = reason
            tickets, self._open = list(self._open), set()
        self._running = 0
        for ticket in tickets:
            self._end(ticket, Failed(500, f"the server's decoding worker stopped ({reason}); the server is shutting "
                                          "down: retry when it is back"))
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:
                log.exception("on_fatal failed")

    def _take(self, block: bool = True) -> Ticket | None:
        """The next job from the queue (None: close); queue.Empty when ``block`` is off and there is none."""
        return self._queue.get(block=block)

    def _forget(self, ticket: Ticket) -> None:
        with self._lock:
            self._open.discard(ticket)

    def _end(self, ticket: Ticket, event) -> None:
        """Send a job's last event and count it."""
        self._forget(ticket)
        ticket.send(event)
        if self.on_finish is not None:
            try:
                self.on_finish(ticket, event)
            except Exception:
                log.exception("metrics update failed")

    def _work(self) -> None:
        """The worker: continuous batching of up to ``max_batch`` jobs (see the module doc). Every
        call that belongs to one job is guarded so that its fault ends that job alone."""
        batch = Batch(self.max_batch, self.decoder.batch_pacer)
        live: dict[Any, Ticket] = {}  # generation -> its ticket
        closing = False

        def stream(gen, events) -> None:
            ticket = live.get(gen)
            if ticket is not None:
                for ev in events:
                    ticket.send(Token(ev.token_id, ev.text, ev.logprob, ev.source))

        def failed(gen, error: Exception) -> None:
            ticket = live.pop(gen, None)
            if ticket is not None:
                self._end(ticket, _failure(error))

        def drop(gen, event) -> None:
            """End ``gen`` with ``event`` (Failed), taking it out of the batch if it is still in."""
            try:
                self.decoder.leave(batch, gen)
            except Exception:  # it is out of ``live``; the batch drops it on its next fault
                log.exception("taking a generation out of the batch failed")
            ticket = live.pop(gen, None)
            if ticket is not None:
                self._end(ticket, event)

        while True:
            while not closing and not batch.full:  # admit: wait for work only when there is none
                try:
                    ticket = self._take(block=not live)
                except queue.Empty:
                    break
                if ticket is None:
                    closing = True
                    break
                if ticket.cancelled:  # its client left while it waited
                    self._forget(ticket)
                    continue
                self._admit(ticket, batch, live, stream, failed, drop)
            for gen, ticket in list(live.items()):  # cancelled requests leave at once
                if ticket.cancelled and gen.finish_reason is None:
                    try:
                        self.decoder.leave(batch, gen)
                    except Exception as e:  # noqa: BLE001 -- this generation fails alone
                        drop(gen, _failure(e))
            self._running = len(batch)
            if len(batch):
                try:
                    with torch.inference_mode():
                        batch.step()
                except Exception as e:  # noqa: BLE001 -- the step's sequences fail, the worker goes on
                    event = _failure(e)
                    for gen in list(live):
                        if gen.finish_reason is None:
                            drop(gen, event)
            for gen, ticket in list(live.items()):  # finished (or cancelled) sequences report
                if gen.finish_reason is not None:
                    del live[gen]
                    try:
                        event = Finished(list(gen.token_ids), gen.text, gen.finish_reason, gen.stats)
                    except Exception as e:  # noqa: BLE001 -- this request gets the fault, the others go on
                        event = _failure(e)
                    self._end(ticket, event)
            self._running = len(batch)
            if closing and not live:
                return

    def _admit(self, ticket: Ticket, batch: Batch, live: dict, stream, failed, drop) -> None:
        """Start ``ticket``'s generation in ``batch``, or end it with Failed."""
        gen = None
        try:
            gen = self._prepare(ticket)
            if isinstance(gen, (Failed, Finished)):
                self._end(ticket, gen)
                return
            live[gen] = ticket
            self.decoder.join(batch, gen, on_events=stream, on_error=failed)
        except Exception as e:  # noqa: BLE001 -- this job fails, the worker goes on
            if gen is not None and gen in live:
                drop(gen, _failure(e))
            else:
                self._end(ticket, _failure(e))

    def _prepare(self, ticket: Ticket):
        """The job's Generation, checked against the context (Started sent), or Failed(400), or
        (max_tokens 0) its Finished: nothing to generate."""
        job, dec = ticket.job, self.decoder
        problem = _input_problem(job)
        if problem is not None:
            return problem
        try:
            # max_tokens 0 (echo only): the prompt is encoded and checked, nothing generated
            gen = dec.start(job.prompt, job.max_tokens or (None if job.max_tokens is None else 1),
                            temperature=job.temperature, top_k=job.top_k,
                            top_p=job.top_p, seed=job.seed, stop=list(job.stop), cancel=lambda: ticket.cancelled,
                            min_p=job.min_p, presence_penalty=job.presence_penalty,
                            frequency_penalty=job.frequency_penalty, repetition_penalty=job.repetition_penalty,
                            logit_bias=dict(job.logit_bias), logprobs=job.logprobs,
                            response_format=job.response_format, max_draft_depth=job.max_draft_depth,
                            prediction=job.prediction, end_tokens=job.end_tokens, cache_prompt=job.cache_prompt)
        except Exception as e:  # noqa: BLE001 -- encoding the prompt failed: this job alone
            return _failure(e)
        context = dec.max_length
        if context is not None and gen.prompt_tokens >= context:
            return Failed(400, f"the prompt has {gen.prompt_tokens} tokens but the model's context is {context} "
                               "tokens: shorten the prompt")
        if job.max_tokens is not None and context is not None and gen.prompt_tokens + job.max_tokens > context:
            return Failed(400, f"the prompt has {gen.prompt_tokens} tokens and max_tokens is {job.max_tokens}, "
                               f"{gen.prompt_tokens + job.max_tokens} in all, but the model's context is {context} "
                               f"tokens: ask for at most {context - gen.prompt_tokens} tokens or shorten the prompt",
                          "max_tokens")
        ticket.prompt_tokens = gen.prompt_tokens
        if job.prompt_logprobs is None:
            ticket.send(Started(gen.prompt_tokens))
        else:
            scored = dec.prompt_logprobs(gen.ids, job.prompt_logprobs)
            ticket.send(Started(gen.prompt_tokens, tuple(gen.ids.tolist()), scored))
        if job.max_tokens == 0:
            return Finished([], "", "length", Stats())
        return gen


def _input_problem(job: Job) -> Failed | None:
    """Failed(400) if the job has text the tokenizer cannot take (the server's schema refuses it
    first; this guards any other caller)."""
    texts: list[tuple[str, Any]] = [("prompt", job.prompt)] if isinstance(job.prompt, str) else []
    if isinstance(job.prompt, (list, tuple)):
        texts += [(f"messages[{i}].{key}", m.get(key)) for i, m in enumerate(job.prompt) if isinstance(m, dict)
                  for key in ("role", "content")]
    texts += [(f"stop[{i}]", s) for i, s in enumerate(job.stop)]
    for where, text in texts:
        problem = text_problem(text) if isinstance(text, str) else None
        if problem:
            return Failed(400, f"{where} {problem}", where)
    return None


def _failure(error: BaseException) -> Failed:
    """The Failed event of a job that raised ``error``: 400 if its input was at fault, else 500."""
    if isinstance(error, ConfigError):
        return Failed(400, str(error))
    if _template_refused(error):
        return Failed(400, f"the model's chat template refused the messages: {error}", "messages")
    log.error("generation failed: %s: %s", type(error).__name__, error, exc_info=error)
    return Failed(500, f"the generation failed: {type(error).__name__}: {error}")


def _template_refused(error: BaseException) -> bool:
    """A chat template's own ``raise_exception`` (e.g. "roles must alternate"), not a broken template."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return False
    return type(error) is TemplateError
