"""OpenAI's response bodies and stream chunks for one request of ``n`` choices.

A request with ``n`` > 1 runs as ``n`` generations of the batch (one scheduler ticket each, seeds
``seed``, ``seed + 1``, ...); ``Response`` holds what the choices share (the id, the creation
time, the model) and each choice's own parsing state (``Choice``: its tool-call parser, its
logprobs). A whole body lists the choices by index; a stream interleaves their chunks as their
tokens come (``stream``), each chunk naming its choice's ``index``, each choice ending with its own
chunk carrying ``finish_reason``, and the usage chunk, if asked for, after all of them. Usage
counts each prompt once (and, in ``prompt_tokens_details.cached_tokens``, its tokens that its
first choice had from the prefix cache) and every choice's tokens; ``usage.speculative`` adds up the choices' target
passes, tokens and accepted drafts. A completions request with several prompts has ``n`` choices
per prompt, prompt i's at indices ``i * n`` to ``i * n + n - 1``. With a ``prediction``,
``usage.completion_tokens_details`` counts its draft tokens the target accepted and refused.
A request whose tools came as the deprecated ``functions`` gets its call as ``function_call``
(``functions`` module). For a thinking model (``reasoning``), a choice's thinking comes back as
``message.reasoning_content`` (streamed: ``delta.reasoning_content``) and only the rest is its
content, the part its tool calls are parsed from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from .errors import APIError
from .functions import as_function_call, calls_finish, function_call_message
from .logprobs import Logprobs
from .metrics import Metrics
from .reasoning import ReasoningStream
from .scheduler import Failed, Finished, Started, Ticket, Token
from .tools import ToolStream, join

log = logging.getLogger("speculant.serve")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def error_of(event: Failed) -> APIError:
    return APIError(event.status, event.message, param=event.param,
                    type="invalid_request_error" if event.status < 500 else "server_error",
                    code="worker_stopped" if event.status == 503 else None)


def stopped(reason: str) -> APIError:
    return APIError(503, f"the server's decoding worker stopped ({reason}); the server is shutting down: "
                         "retry when it is back", type="server_error", code="worker_stopped")


class Choice:
    """One choice's parsing state: ``tools`` parses its tool calls out of its text (None: the
    request has no tools; ``bare``: the tools whose calls may come without tags, ``tools.ToolStream``),
    ``reasoning`` splits its thinking from its answer (None: the model has no thinking template;
    True: its prompt opened the thinking), ``logprobs`` collects its tokens' logprobs (None: not
    asked for)."""

    def __init__(self, index: int, logprobs: Logprobs | None, tools: str | None, bare: tuple[str, ...] = (),
                 reasoning: bool | None = None):
        self.index = index
        self.logprobs = logprobs
        self.tools = None if tools is None else ToolStream(tools, names=bare)
        self.reasoning = None if reasoning is None else ReasoningStream(reasoning)

    @property
    def parsed(self) -> bool:
        """Whether its text is parsed (for calls or thinking) rather than sent as it comes."""
        return self.tools is not None or self.reasoning is not None


class Response:
    """One response's identity and its ``n`` choices. ``logprobs`` makes a choice's Logprobs
    (None: not asked for); ``tools`` is the template's tool-call format (None: no tools), ``bare``
    the tools whose calls may come without tags (``Choice``); ``echo``: each choice's prompt text
    (completions with echo), or one for all; ``per_prompt``: choices per prompt (the request's n);
    ``prediction``: the request has one (usage then counts its tokens); ``functions``: a call
    comes back in the deprecated shape, ``function_call``; ``reasoning``: a thinking model's
    (``Choice``)."""

    def __init__(self, kind: str, model: str, method: str, arrived: float, metrics: Metrics, n: int = 1,
                 logprobs: Callable[[], Logprobs] | None = None, tools: str | None = None,
                 echo: str | Sequence[str] | None = None, bare: tuple[str, ...] = (), per_prompt: int = 1,
                 prediction: bool = False, functions: bool = False, reasoning: bool | None = None):
        self.kind, self.model, self.method, self.arrived, self.metrics = kind, model, method, arrived, metrics
        self.choices = [Choice(i, None if logprobs is None else logprobs(), tools, bare, reasoning)
                        for i in range(n)]
        # completions with echo: each choice's prompt, which its text starts with
        self.echo = None if echo is None else [echo] * n if isinstance(echo, str) else list(echo)
        self.per_prompt, self.prediction, self.functions = per_prompt, prediction, functions
        self.echoed: list[dict | None] = [None] * n  # each choice's prompt logprobs object, once started
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.first = True

    def started(self, index: int, event: Started) -> None:
        """Take choice ``index``'s Started event: with echo and logprobs, the prompt's tokens come first."""
        lp = self.choices[index].logprobs
        if self.echo is not None and lp is not None:
            self.echoed[index] = lp.add_prompt(event.prompt_ids, event.prompt_logprobs, self.echo[index])

    def token(self, index: int, event: Token) -> dict | None:
        """Take choice ``index``'s token event; returns its logprobs object (None: not asked for)."""
        if self.first:
            self.metrics.first_token(time.perf_counter() - self.arrived)
            self.first = False
        lp = self.choices[index].logprobs
        return None if lp is None else lp.add(event)

    def prompt_tokens(self, tickets: Sequence[Ticket]) -> int:
        """The request's prompt tokens: each prompt's once (its first choice's ticket)."""
        return sum(t.prompt_tokens for t in tickets[::self.per_prompt])

    def usage(self, events: Sequence[Finished], prompt_tokens: int) -> dict[str, Any]:
        """The request's usage: each prompt's tokens once, and of them the ones its first choice
        had from the prefix cache (``prompt_tokens_details.cached_tokens``, OpenAI's field), every
        choice's completion tokens."""
        stats = [e.stats for e in events if e.stats is not None]
        n = sum(len(e.token_ids) for e in events)
        cached = sum(e.stats.cached_tokens for e in events[::self.per_prompt] if e.stats is not None)
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n, "prompt_tokens_details": {"cached_tokens": cached}}
        if self.prediction:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(s.prediction_accepted for s in stats),
                "rejected_prediction_tokens": sum(s.prediction_rejected for s in stats)}
        usage["speculative"] = speculative_usage(self.method, stats)
        return usage

    def body(self, events: Sequence[Finished], prompt_tokens: int) -> dict[str, Any]:
        """The whole response: ``events[i]`` is choice i's Finished."""
        choices = []
        for choice, event in zip(self.choices, events):
            reason = FINISH[event.finish_reason]
            logprobs = None if choice.logprobs is None else choice.logprobs.all
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": event.text}
                if choice.parsed:
                    deltas = self._parsed(choice, event.text) + self._parsed(choice, None)
                    message["content"], calls = join(deltas)
                    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
                    if reasoning:
                        message["reasoning_content"] = reasoning
                    if calls and self.functions:
                        function_call_message(message, calls)
                    elif calls:
                        message["tool_calls"] = calls
                    reason = calls_finish(reason, self.functions) if calls else reason
                choices.append({"index": choice.index, "message": message, "logprobs": logprobs,
                                "finish_reason": reason})
            else:
                echoed = self.echo[choice.index] if self.echo is not None else ""
                choices.append({"index": choice.index, "text": echoed + event.text, "logprobs": logprobs,
                                "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(events, prompt_tokens)}

    def deltas(self, choice: Choice, text: str | None) -> list[dict]:
        """The deltas of choice's next ``text`` (None: its end), its calls in the request's shape."""
        deltas = self._parsed(choice, text)
        return as_function_call(deltas) if self.functions else deltas

    @staticmethod
    def _parsed(choice: Choice, text: str | None) -> list[dict]:
        """The deltas of choice's next ``text`` (None: its end): its thinking as reasoning_content,
        the rest as content with its tool calls parsed out."""
        if choice.reasoning is None:
            parts = [] if text is None else [{"content": text}]
        else:
            parts = choice.reasoning.finish() if text is None else choice.reasoning.feed(text)
        if choice.tools is None:
            return parts
        out: list[dict] = []
        for part in parts:
            out += choice.tools.feed(part["content"]) if "content" in part else [part]
        return (out + choice.tools.finish()) if text is None else out

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              usage: dict | None = None, logprobs: dict | None = None, delta: dict | None = None,
              index: int = 0, source: str | None = None) -> str:
        if usage is not None:
            choices: list = []
        elif self.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        else:
            choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
        if source is not None and choices:  # the extension speculative.sources
            choices[0]["source"] = source
        body = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"


def speculative_usage(method: str, stats: Sequence) -> dict[str, Any]:
    """``usage.speculative``: the method and the generations' (``decoding.Stats``) target passes,
    tokens per pass and acceptance, added up."""
    calls = sum(s.target_calls for s in stats)
    proposed = sum(sum(s.drafted_per_call) for s in stats)
    accepted = sum(sum(s.accepted_per_call) for s in stats)
    return {"method": method, "target_calls": calls,
            "tokens_per_call": sum(s.new_tokens for s in stats) / calls if calls else 0.0,
            "acceptance_rate": accepted / proposed if proposed else 0.0}


POLL_S = 0.25  # how often a waiting request looks at the worker and at its client


class ClientGone(Exception):
    """The client went away while its request waited (its tickets are cancelled)."""


async def next_event(ticket: Ticket, problem: Callable[[], str | None],
                     gone: Callable[[], Awaitable[bool]] | None = None) -> Any:
    """The ticket's next event. A worker that stopped for good (``problem()`` names why) gives a
    503 :class:`Failed` once nothing is left queued; ``gone`` (an async check, e.g. Starlette's
    ``Request.is_disconnected``) true while waiting cancels the ticket and raises :class:`ClientGone`."""
    while True:
        try:
            return await asyncio.wait_for(ticket.events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
            reason = problem()
            if reason is not None and ticket.events.empty():
                return Failed(503, stopped(reason).message)
            if gone is not None and await gone():
                ticket.cancel()
                raise ClientGone from None


async def merged(tickets: Sequence[Ticket], problem: Callable[[], str | None],
                 gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) of every ticket as the events come, until each has finished or
    failed (:func:`next_event` for each; ``gone``, checked here once for all of them, cancels every
    ticket and raises :class:`ClientGone`)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, ticket: Ticket) -> None:
        while True:
            event = await next_event(ticket, problem)
            await queue.put((index, event))
            if isinstance(event, (Finished, Failed)):
                return

    tasks = [asyncio.create_task(forward(i, t)) for i, t in enumerate(tickets)]
    try:
        left = len(tickets)
        while left:
            try:
                index, event = await asyncio.wait_for(queue.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                if gone is not None and await gone():
                    for ticket in tickets:
                        ticket.cancel()
                    raise ClientGone from None
                continue
            left -= isinstance(event, (Finished, Failed))
            yield index, event
    finally:
        for task in tasks:
            task.cancel()


async def stream(tickets: Sequence[Ticket], include_usage: bool, response: Response,
                 problem: Callable[[], str | None], sources: bool = False, observer: Any = None) -> AsyncIterator[str]:
    """The server-sent events of one request (module doc); the client going away cancels every
    choice's generation. ``observer`` (an adapter's, ``conversation.Observer``) gets the Finished
    events in ``finished`` before the usage chunk. A fault after the stream has begun is sent as OpenAI does, ``data:
    {"error": {...}}``, and ends it (the other choices are cancelled)."""
    finished: dict[int, Finished] = {}
    try:
        if response.kind == "chat":
            for choice in response.choices:
                yield response.chunk(role=True, index=choice.index)
        elif response.echo is not None:  # the prompt first, in a chunk of its own per choice
            for choice in response.choices:
                yield response.chunk(response.echo[choice.index], logprobs=response.echoed[choice.index],
                                     index=choice.index)
        async with aclosing(merged(tickets, problem)) as events:  # a break ends its forwarding tasks at once
            async for index, event in events:
                choice = response.choices[index]
                if isinstance(event, Token):
                    logprobs = response.token(index, event)
                    source = event.source if sources else None
                    every = logprobs is not None or sources  # then every token has its chunk
                    if choice.parsed:
                        deltas = response.deltas(choice, event.text) or ([{}] if every else [])
                        for i, delta in enumerate(deltas):  # the token's logprobs ride with its first chunk
                            yield response.chunk(delta=delta, logprobs=logprobs if i == 0 else None, index=index,
                                                 source=source if i == 0 else None)
                    elif event.text or every:
                        yield response.chunk(event.text, logprobs=logprobs, index=index, source=source)
                elif isinstance(event, Finished):
                    finish = FINISH[event.finish_reason]
                    if choice.parsed:
                        for delta in response.deltas(choice, None):
                            yield response.chunk(delta=delta, index=index)
                        calls = choice.tools is not None and choice.tools.calls
                        finish = calls_finish(finish, response.functions) if calls else finish
                    yield response.chunk(None, finish=finish, index=index)
                    finished[index] = event
                elif isinstance(event, Failed):
                    yield f"data: {json.dumps(error_of(event).body())}\n\n"
                    break
                elif isinstance(event, Started):
                    continue
        if observer is not None and len(finished) == len(tickets):
            observer.finished = [finished[i] for i in range(len(tickets))]
        if include_usage and len(finished) == len(tickets):
            yield response.chunk(usage=response.usage([finished[i] for i in range(len(tickets))],
                                                      response.prompt_tokens(tickets)))
    except Exception as e:  # the headers are sent: the fault goes in the stream
        log.exception("stream failed")
        error = APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        for ticket in tickets:
            ticket.cancel()  # a no-op when it finished; else it stops within one decoding step
    yield "data: [DONE]\n\n"
