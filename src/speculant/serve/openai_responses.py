"""OpenAI's Responses API, ``POST /v1/responses``, as an adapter over the chat path
(``conversation``): what Codex CLI and OpenAI's newer SDK calls send.

Request: ``model`` (any name; the served model answers), ``input`` (a string, or a list of items:
``message`` {role, content: a string or ``input_text`` / ``output_text`` parts},
``function_call`` {call_id, name, arguments}, ``function_call_output`` {call_id, output};
``reasoning`` items are skipped), ``instructions`` (the system message), ``tools`` (function tools
{type: "function", name, description, parameters, strict}), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``json_schema`` and ``json_object``: the chat path's
``response_format`` grammar), ``max_output_tokens``, ``temperature``, ``top_p``, ``reasoning``
({effort}: the chat template's thinking switch where the model has one; ignored otherwise) and
``stream``. ``store`` and ``previous_response_id``: a response asked to be stored is kept in
memory, the last ``STORED`` of them (least recently used dropped first; gone on restart), and a
request naming one continues its conversation (its input and output; not its instructions);
naming one not kept is a 404. Accepted and ignored: ``metadata``, ``user``, ``include``,
``prompt_cache_key`` (the prefix cache needs no key), ``service_tier``, ``truncation``,
``safety_identifier``, ``client_metadata``, ``reasoning.summary``, ``text.verbosity``. Left out and
logged (``conversation.ignore``): other top-level fields, tools other than functions
(``web_search``, ``namespace``, ``file_search``, ...: speculant runs no tools itself; Codex CLI
sends some with its function tools) and input items of server-side tools (``web_search_call``,
...); an image in a function's output becomes a line saying it was left out. Refused with a 400:
image, file and audio inputs in a message, and a malformed field.

Response: ``{"object": "response", "status": "completed" | "incomplete", "output": [reasoning,
message, function_call items], "usage": {...}}``; streamed, the Responses events from
``response.created`` to ``response.completed``, each with its ``sequence_number`` (and
``response.in_progress`` again whenever the stream has been quiet for ``conversation.KEEPALIVE``
seconds, as a keep-alive). Errors in
OpenAI's shape, as the chat path's.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .conversation import (ChatPath, Chunks, Gone, Observer, fold_system, ignore, paced, pieces_of_delta,
                           pieces_of_message, text_of_blocks, tool_function)
from .errors import APIError, bad_request, kind_of

log = logging.getLogger("speculant.serve")
STORED = 256  # responses kept for previous_response_id
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "temperature", "top_p", "reasoning", "stream", "store", "previous_response_id"}
IGNORED = {"metadata", "user", "include", "prompt_cache_key", "service_tier", "truncation", "safety_identifier",
           "stream_options", "background", "client_metadata"}
API = "/v1/responses"
TEXT_PARTS = ("input_text", "output_text", "text")


class Store:
    """The stored responses' conversations (chat messages), the last ``size`` used."""

    def __init__(self, size: int = STORED):
        self.size = size
        self._kept: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, key: str) -> list[dict]:
        if key not in self._kept:
            raise APIError(404, f"'previous_response_id' {key[:80]!r} is not stored here: the server keeps the last "
                                f"{self.size} responses made with \"store\": true, in memory (none survive a "
                                "restart); send the whole conversation as 'input' instead",
                           param="previous_response_id", code="previous_response_not_found")
        self._kept.move_to_end(key)
        return list(self._kept[key])

    def put(self, key: str, messages: list[dict]) -> None:
        self._kept[key] = messages
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


def _output(value: Any, where: str) -> str:
    """A function's output (a string or content parts) as text; a part the model cannot read becomes a line."""
    if not isinstance(value, list):
        return _content(value, where)
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(kind, str):
            ignore(API, f"{kind!r} parts in function outputs", "the served model reads text only")
            parts.append(f"[{kind} left out: the model reads text only]")
        else:
            raise bad_request(f"{where}[{j}] must be a part {{\"type\": \"input_text\", \"text\": ...}}",
                              param=f"{where}[{j}]")
    return "\n".join(parts)


def _content(value: Any, where: str) -> str:
    if isinstance(value, list):
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_file", "input_audio"):
                raise bad_request(f"{where}[{j}]: {kind} is not supported: the served model reads text only",
                                  param=f"{where}[{j}]")
    return text_of_blocks(value, where, TEXT_PARTS)


def input_messages(value: Any) -> list[dict]:
    """``input`` as chat messages; a 400 naming the item at fault."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"'input' must be a string or a list of items, got {kind_of(value)}", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where} must be {{\"type\": \"function_call\", \"call_id\", \"name\", "
                                  "\"arguments\": JSON string}", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be the call_id of the function_call it answers",
                                  param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _output(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str) and kind.endswith(("_call", "_call_output")):
            ignore(API, f"input items of type {kind!r}", "a server-side tool's; speculant runs no tools itself")
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported (send message, function_call, "
                              "function_call_output)", param=where)
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {\"type\": \"function\", \"name\", \"parameters\"}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"name\", \"parameters\"}}", param=where)
        if kind != "function":
            ignore(API, f"tools of type {kind!r}", "speculant runs no tools itself; only function tools are given to "
                   "the model")
            continue
        out.append(tool_function(tool.get("name"), tool.get("description"), tool.get("parameters"), where,
                                 tool.get("strict")))
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in (None, "auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\"}",
                      param="tool_choice")


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                      "\"json_schema\", \"name\", \"schema\"}", param="text.format")


def chat_body(body: Any, model_id: str, chat: ChatPath, store: Store) -> tuple[dict, list[dict]]:
    """The Chat Completions body of a Responses request, and the conversation to store with the output."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind_of(body)}")
    for name in sorted(set(body) - FIELDS - IGNORED):
        ignore(API, f"the field {name!r}", "not supported here")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (any name: the server answers with its model)", param="model")
    if body.get("input") is None:
        raise bad_request("'input' is required: a string or a list of items", param="input")
    history = store.get(body["previous_response_id"]) if body.get("previous_response_id") is not None else []
    conversation = history + input_messages(body["input"])
    messages = list(conversation)
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("'instructions' must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    out: dict[str, Any] = {"model": model_id, "messages": fold_system(messages)}
    for name, to in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("stream", "stream"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(name) is not None:
            out[to] = body[name]
    tools = _tools(body["tools"]) if body.get("tools") else []
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None and (out.get("tools") or choice == "none"):
        out["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        if not isinstance(reasoning, dict):
            raise bad_request("'reasoning' must be {\"effort\": ...}", param="reasoning")
        if effort is not None and chat.thinking.switch:
            out["reasoning_effort"] = effort
    return out, conversation


class Output:
    """A response's output items, built from the chat answer's pieces (``conversation``)."""

    def __init__(self):
        self.items: list[dict] = []
        self.calls: dict[int, dict] = {}  # a call's index: its item

    def add(self, piece: tuple) -> tuple[str, dict, bool]:
        """Take one piece; returns (kind, its item, whether the item is new)."""
        kind = piece[0]
        last = self.items[-1] if self.items else None
        if kind == "thinking":
            new = last is None or last["type"] != "reasoning"
            if new:
                self.items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}]})
            self.items[-1]["content"][0]["text"] += piece[1]
        elif kind == "text":
            new = last is None or last["type"] != "message"
            if new:
                self.items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed",
                                   "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                     "annotations": []}]})
            self.items[-1]["content"][0]["text"] += piece[1]
        elif kind == "call":
            new = True
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": piece[2], "name": piece[3],
                    "arguments": "", "status": "completed"}
            self.items.append(item)
            self.calls[piece[1]] = item
        else:
            new = False
            self.calls[piece[1]]["arguments"] += piece[2]
        return kind, self.items[-1] if kind != "arguments" else self.calls[piece[1]], new

    def message(self) -> dict:
        """The output as the chat message it is in a later turn."""
        text = "".join(c["text"] for i in self.items if i["type"] == "message" for c in i["content"])
        out: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            out["tool_calls"] = calls
        return out


def response(key: str, created: int, model: str, output: Output, observer: Observer | None, chat: ChatPath,
             status: str = "completed") -> dict:
    usage = None
    incomplete = None
    if observer is not None:
        thought = sum(chat.count(c["text"]) for i in output.items if i["type"] == "reasoning" for c in i["content"])
        usage = {"input_tokens": observer.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": observer.cached_tokens},
                 "output_tokens": observer.output_tokens,
                 "output_tokens_details": {"reasoning_tokens": min(thought, observer.output_tokens)},
                 "total_tokens": observer.prompt_tokens + observer.output_tokens}
        if observer.reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {"id": key, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output.items, "usage": usage, "incomplete_details": incomplete,
            "error": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


async def events(chunks: Chunks, key: str, model: str, chat: ChatPath, finish) -> AsyncIterator[str]:
    """The Responses stream of a streamed chat answer; ``finish(output)`` stores it when asked."""
    created, output, number = int(time.time()), Output(), 0

    def event(name: str, **data) -> str:
        nonlocal number
        number += 1
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': number - 1, **data})}\n\n"

    def done(item: dict) -> list[str]:
        at = output.items.index(item)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return [event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=text),
                    event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                          part=item["content"][0]),
                    event("response.output_item.done", output_index=at, item=item)]
        if item["type"] == "function_call":
            return [event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                          arguments=item["arguments"]),
                    event("response.output_item.done", output_index=at, item=item)]
        return [event("response.output_item.done", output_index=at, item=item)]

    yield event("response.created", response=response(key, created, model, output, None, chat, "in_progress"))
    yield event("response.in_progress", response=response(key, created, model, output, None, chat, "in_progress"))
    try:
        async for chunk in paced(chunks.chunks):
            if chunk is None:  # quiet for a while: the in-progress event again, as a keep-alive
                yield event("response.in_progress",
                            response=response(key, created, model, output, None, chat, "in_progress"))
                continue
            if "error" in chunk:
                yield event("error", code="server_error", message=chunk["error"].get("message", "failed"), param=None)
                return
            for piece in pieces_of_delta(chunk):
                before = output.items[-1] if output.items else None
                kind, item, new = output.add(piece)
                at = output.items.index(item)
                if new:
                    if before is not None:
                        for line in done(before):
                            yield line
                    empty = dict(item, arguments="") if kind == "call" else \
                        dict(item, content=[dict(item["content"][0], text="")])
                    yield event("response.output_item.added", output_index=at, item=empty)
                    if kind == "text":
                        yield event("response.content_part.added", item_id=item["id"], output_index=at,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                if kind == "text":
                    yield event("response.output_text.delta", item_id=item["id"], output_index=at, content_index=0,
                                delta=piece[1])
                elif kind == "thinking":
                    yield event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                                content_index=0, delta=piece[1])
                elif kind == "arguments":
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=piece[2])
        if output.items:
            for line in done(output.items[-1]):
                yield line
        finish(output)
        yield event("response.completed", response=response(key, created, model, output, chunks.observer, chat))
    except Exception as e:  # the headers are sent: the fault goes in the stream (logged)
        log.exception("stream failed")
        yield event("error", code="server_error", message=f"the request failed: {type(e).__name__}: {e}", param=None)
    finally:
        await chunks.chunks.aclose()


def add_responses_routes(app: FastAPI, chat: ChatPath, store: Store | None = None) -> None:
    """POST /v1/responses on ``app``."""
    store = store or Store()
    app.state.responses = store

    @app.post("/v1/responses")
    async def responses(request: Request):
        try:
            body = await chat.body(request)
            chat_request, conversation = chat_body(body, chat.model_id, chat, store)
            if body.get("store") is not None and not isinstance(body["store"], bool):
                raise bad_request("'store' must be true or false", param="store")
            answer = await chat.run(request, chat_request)
        except APIError as e:
            return e.response()
        except Gone:
            return Response(status_code=499)
        key, model = "resp_" + uuid.uuid4().hex, body["model"]

        def finish(output: Output) -> None:
            if body.get("store"):
                store.put(key, conversation + [output.message()])

        if isinstance(answer, Chunks):
            return StreamingResponse(events(answer, key, model, chat, finish), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        output = Output()
        for piece in pieces_of_message(answer.body["choices"][0]["message"]):
            output.add(piece)
        finish(output)
        return response(key, int(time.time()), model, output, answer.observer, chat)
