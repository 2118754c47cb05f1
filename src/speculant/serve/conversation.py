"""What the agent-facing APIs (Anthropic's Messages: ``anthropic``; OpenAI's Responses:
``openai_responses``) share: they are adapters over the chat path.

An adapter turns its request into a Chat Completions body (messages, tools, tool_choice, stop,
sampling fields) and runs it through the app's own chat handler (``ChatPath.run``), so the chat
template, the tool-call parser, grammar constraints, speculation, batching, penalties and the
prefix cache all apply as they do to ``/v1/chat/completions``. What comes back is taken apart
here into one sequence of pieces both adapters render in their own shapes: ``("thinking", text)``,
``("text", text)``, ``("call", index, id, name)`` and ``("arguments", index, text)``
(``pieces_of_delta`` for a streamed chunk, ``pieces_of_message`` for a whole message). The
``Observer`` an adapter passes is told the prompt's size and given the finished generations, for
what the chat body does not carry: the prompt tokens served from the prefix cache and which stop
sequence ended the text (``stop_of``). A streamed answer goes through ``paced``: with no chunk for
``KEEPALIVE`` seconds (a long prefill, or a tool call, whose text is held back until it is
whole) the adapter sends its keep-alive event, since the agents end a stream that stays quiet
for a while (Claude Code and Codex CLI after 5 minutes). ``fold_system`` puts the system turns
an agent sends between the others where every chat template takes them.
``Observer.cap_tokens``: the request's token limit is a cap (Anthropic's required
``max_tokens``, which agents set near the context), cut to the room the prompt leaves instead
of refused.

What a real agent sends that cannot be applied here (a field this server does not know, a tool it
cannot run, a block the model cannot read inside a tool result) is left out and logged once
(``ignore``) rather than refused: the agents' command lines add fields from one version to the
next. Errors stay :class:`~speculant.serve.errors.APIError` until the adapter renders them in its
shape.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, suppress
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterable, Callable, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import APIError, bad_request
from .schema import parse_request

log = logging.getLogger("speculant.serve")
KEEPALIVE = 15.0  # seconds a stream may stay quiet before the adapter sends a keep-alive event
_IGNORED: set[tuple[str, str]] = set()  # what ``ignore`` has logged already


def ignore(api: str, what: str, why: str) -> None:
    """Log, once per ``api`` and ``what``, that a request's ``what`` was left out, and ``why``."""
    if (api, what) not in _IGNORED:
        _IGNORED.add((api, what))
        log.warning("speculant: %s: ignoring %s (%s)", api, what, why)


@dataclass
class Observer:
    """What the chat handler tells an adapter: the prompt's tokens (once started) and the
    Finished events (once done); ``cap_tokens`` as in the module doc."""
    cap_tokens: bool = False
    prompt_tokens: int = 0
    finished: list = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens served from the prefix cache (``Stats.cached_tokens``)."""
        return sum(getattr(e.stats, "cached_tokens", 0) or 0 for e in self.finished if e.stats is not None)

    @property
    def output_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.finished)

    @property
    def reason(self) -> str | None:
        """The generation's finish reason: "eos", "stop", "length", "cancelled" (None: not finished)."""
        return self.finished[0].finish_reason if self.finished else None


@dataclass
class Answer:
    body: dict
    observer: Observer


@dataclass
class Chunks:
    """A streamed answer: ``chunks`` yields the chat chunks as dicts (an ``{"error": ...}`` one
    for a fault after the start)."""
    chunks: AsyncGenerator[dict, None]
    observer: Observer


class ChatPath:
    """The app's chat handler and what the adapters need of the model."""

    def __init__(self, model_id: str, complete: Callable, authorize: Callable, read_json: Callable,
                 chat_prompt: Callable, thinking: Any, tokenizer: Any):
        self.model_id, self.complete, self.authorize, self.read_json = model_id, complete, authorize, read_json
        self._chat_prompt, self.thinking, self.tokenizer = chat_prompt, thinking, tokenizer

    async def body(self, request: Request) -> Any:
        """The request's JSON (authorised first)."""
        self.authorize(request)
        return await self.read_json(request)

    async def run(self, request: Request, chat: dict, cap_tokens: bool = False) -> Answer | Chunks:
        """Run the chat body ``chat``; an APIError (OpenAI's shape) for a refusal or a failure."""
        observer = Observer(cap_tokens=cap_tokens)
        reply = await self.complete(request, "chat", chat, observer)
        if isinstance(reply, StreamingResponse):
            return Chunks(_chunks(reply.body_iterator), observer)
        if reply.status_code == 499:
            raise Gone
        body = json.loads(reply.body)
        if reply.status_code != 200:
            error = body.get("error", {})
            raise APIError(reply.status_code, error.get("message", "the request failed"),
                           type=error.get("type", "server_error"), param=error.get("param"), code=error.get("code"),
                           headers={k: v for k, v in reply.headers.items() if k.lower() == "retry-after"})
        return Answer(body, observer)

    async def prompt_tokens(self, chat: dict) -> int:
        """The tokens of the prompt the chat path builds for ``chat`` (the chat template's)."""
        req = parse_request(chat, "chat")
        self.thinking.check(req.template_variables, req.reasoning_effort)
        ids, _ = await asyncio.get_running_loop().run_in_executor(None, self._chat_prompt, req)
        return len(ids)

    def thinking_variables(self, enabled: bool | None) -> dict:
        """``chat_template_kwargs`` turning the model's thinking on or off: empty for a model
        without the switch (it answers as it always does) or when ``enabled`` is None."""
        if enabled is None or not self.thinking.switch:
            return {}
        return {"chat_template_kwargs": {"enable_thinking": enabled}}

    def stop_of(self, observer: Observer, stops: list[str]) -> str | None:
        """The stop sequence that ended the text (None: it did not end on one)."""
        if observer.reason != "stop" or not stops:
            return None
        event = observer.finished[0]
        rest = self.tokenizer.decode(event.token_ids)[len(event.text):]
        return next((s for s in stops if rest.startswith(s)), next((s for s in stops if s in rest), stops[0]))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids) if text else 0


class Gone(Exception):
    """The client went away (the chat handler answered 499)."""


async def _chunks(lines: AsyncIterable[Any]) -> AsyncGenerator[dict, None]:
    """The chat stream's chunks as dicts, until ``[DONE]``; closing this closes the stream (which
    cancels the generation)."""
    async with aclosing(cast(AsyncGenerator[Any, None], lines)) as source:
        async for line in source:
            for event in line.split("\n\n"):
                if not event.startswith("data: "):
                    continue
                data = event[len("data: "):]
                if data == "[DONE]":
                    return
                yield json.loads(data)


async def paced(chunks: AsyncGenerator[dict, None], every: float = KEEPALIVE) -> AsyncGenerator[dict | None, None]:
    """``chunks``, with a None whenever ``every`` seconds pass without one; closing this closes ``chunks``."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(chunks))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await chunks.aclose()


def pieces_of_delta(chunk: dict) -> list[tuple]:
    """A chat chunk's pieces (module doc); its ``finish_reason`` is read by the adapter."""
    out: list[tuple] = []
    for choice in chunk.get("choices", ()):
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            out.append(("thinking", delta["reasoning_content"]))
        if delta.get("content"):
            out.append(("text", delta["content"]))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function", {})
            if "id" in call:
                out.append(("call", call["index"], call["id"], fn.get("name", "")))
            if fn.get("arguments"):
                out.append(("arguments", call["index"], fn["arguments"]))
    return out


def pieces_of_message(message: dict) -> list[tuple]:
    """A whole chat message's pieces, in the order a stream would give them."""
    out: list[tuple] = []
    if message.get("reasoning_content"):
        out.append(("thinking", message["reasoning_content"]))
    if message.get("content"):
        out.append(("text", message["content"]))
    for i, call in enumerate(message.get("tool_calls") or ()):
        out += [("call", i, call["id"], call["function"]["name"]), ("arguments", i, call["function"]["arguments"])]
    return out


def arguments_object(text: str) -> dict:
    """A call's arguments (the parser's JSON text) as an object."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def fold_system(messages: list[dict]) -> list[dict]:
    """Chat messages with their system (and developer) messages where chat templates take them: those
    before the first assistant message joined into one system message first; a later one added to
    the user message before it, or made one; consecutive user messages joined (as Anthropic's API
    joins consecutive turns of one role). Claude Code sends its environment as a system turn after
    the user's request, Codex CLI two developer messages: many templates refuse a system message
    after the first, and a small model tends to continue the last message rather than answer."""
    system: list[str] = []
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        if role in ("system", "developer"):
            if not any(m["role"] == "assistant" for m in out):
                system.append(message["content"])
                continue
            message = {"role": "user", "content": message["content"]}
            role = "user"
        if role == "user" and out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], str) \
                and isinstance(message["content"], str):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + message["content"]}
            continue
        out.append(message)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def text_of_blocks(value: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text blocks ``{"type": <one of kinds>, "text": ...}``, as one string;
    a 400 naming ``where`` for anything else."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param=where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") not in kinds or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}[{i}] must be a text block {{\"type\": {kinds[0]!r}, \"text\": ...}}"
                              + (f", got a {kind!r} block: this server takes text only" if kind else ""),
                              param=f"{where}[{i}]")
        parts.append(block["text"])
    return "\n".join(parts)


def tool_function(name: Any, description: Any, schema: Any, where: str, strict: Any = None) -> dict:
    """A chat tool ``{"type": "function", "function": {...}}`` from an adapter's tool fields
    (the chat path checks them; ``where`` names the tool in a message)."""
    if schema is not None and not isinstance(schema, dict):
        raise bad_request(f"{where}: the input schema must be a JSON schema object", param=where)
    fn = {"name": name, "description": description, "parameters": schema, "strict": strict}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
