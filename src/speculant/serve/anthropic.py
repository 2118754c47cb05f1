"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, as an
adapter over the chat path (``conversation``): what Claude Code and Anthropic's SDKs send.

Request: ``model`` (any name: agents send their own, e.g. ``claude-sonnet-4-5``; the served model
answers), ``max_tokens`` (required; a cap: cut to the room the prompt leaves in the context),
``system`` (a string or text blocks), ``messages`` (user and assistant turns, and the system turns
Claude Code puts between them; a string or blocks: ``text``, ``tool_use`` {id, name, input},
``tool_result`` {tool_use_id, content: a string or blocks, is_error}, ``thinking`` /
``redacted_thinking`` given back), ``tools`` ({name, description, input_schema}), ``tool_choice``
(``auto``, ``any``, ``tool`` with a name, ``none``; ``disable_parallel_tool_use``),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``, ``thinking`` ({"type":
"enabled", "budget_tokens"}, "adaptive" or "disabled": the chat template's thinking switch where
the model has one; a model without one answers as it always does) and ``output_config.format``
(a ``json_schema``: the chat path's ``response_format`` grammar). ``cache_control`` anywhere is
accepted (the prefix cache keeps every prompt's blocks anyway) and so are ``metadata``,
``service_tier``, ``context_management``, ``output_config.effort``, a tool's ``defer_loading``
(every tool given is in the prompt) and the ``anthropic-version`` and ``anthropic-beta`` headers.
Left out and logged (``conversation.ignore``): other top-level fields, server tools
(``web_search_...``, ``bash_...``: a tool here is one the client runs) and, inside a tool result,
blocks other than text (an image becomes a line saying it was left out; a ``tool_reference``, a
line naming the tool). Refused with a 400: ``image`` and ``document`` blocks in a turn (the model
reads text only) and a malformed field.

Response: ``{"type": "message", "content": [thinking | text | tool_use blocks], "stop_reason":
"end_turn" | "max_tokens" | "stop_sequence" | "tool_use", "usage": {...}}``; streamed, Anthropic's
events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, a ``ping`` after the start and whenever the stream has been quiet for
``conversation.KEEPALIVE`` seconds). Errors ``{"type": "error", "error": {"type",
"message"}}``.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .conversation import (Answer, ChatPath, Chunks, Gone, Observer, arguments_object, fold_system, ignore, paced,
                           pieces_of_delta, pieces_of_message, text_of_blocks, tool_function)
from .errors import APIError, bad_request, kind_of

log = logging.getLogger("speculant.serve")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
          "top_k", "tools", "tool_choice", "thinking", "output_config"}
IGNORED = {"metadata", "service_tier", "context_management"}  # they change nothing generated here
API = "/v1/messages"


def error_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: APIError) -> Response:
    return Response(json.dumps(error_body(e)), status_code=e.status, headers=e.headers,
                    media_type="application/json")


def chat_body(body: Any, model_id: str, thinking_variables, count_only: bool = False) -> tuple[dict, list[str]]:
    """The Chat Completions body of a Messages request, and its stop sequences; a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind_of(body)}")
    for name in sorted(set(body) - FIELDS - IGNORED):
        ignore(API, f"the field {name!r}", "not supported here")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (any name: the server answers with its model)", param="model")
    messages: list[dict] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": text_of_blocks(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_request("'messages' must be a non-empty list of {\"role\": \"user\"|\"assistant\", \"content\"}",
                          param="messages")
    for i, turn in enumerate(turns):
        messages += _turn(turn, f"messages[{i}]")
    chat: dict[str, Any] = {"model": model_id, "messages": fold_system(messages)}
    if not count_only:
        limit = body.get("max_tokens")
        if limit is None:
            raise bad_request("'max_tokens' is required: the most tokens to generate", param="max_tokens")
        chat["max_tokens"] = limit
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("'stop_sequences' must be a list of strings", param="stop_sequences")
        chat["stop"] = stops or None
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("tools"):
        chat.update(_tools(body["tools"], body.get("tool_choice")))
    elif body.get("tool_choice") is not None and _choice_type(body["tool_choice"]) in ("any", "tool"):
        raise bad_request("'tool_choice' \"any\" or \"tool\" needs 'tools'", param="tool_choice")
    chat.update(thinking_variables(_thinking(body.get("thinking"))))
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, list(stops or ())


def _output_format(config: Any) -> dict | None:
    """``output_config``'s ``format`` as the chat path's ``response_format`` (its ``effort`` changes nothing)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_request("'output_config' must be an object ({\"format\", \"effort\"})", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _choice_type(choice: Any) -> Any:
    return choice.get("type") if isinstance(choice, dict) else choice


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": "
                          "\"adaptive\"} or {\"type\": \"disabled\"}", param="thinking")
    return kind != "disabled"


def _turn(turn: Any, where: str) -> list[dict]:
    """One Messages turn as chat messages: a user turn's tool results become ``tool`` messages."""
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant", "system"):
        raise bad_request(f"{where} must be {{\"role\": \"user\"|\"assistant\", \"content\": ...}}", param=where)
    role, content = turn["role"], turn.get("content")
    if role == "system":  # Claude Code's system turns between the others
        return [{"role": "system", "content": text_of_blocks(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text must be a string", param=f"{at}.text")
            text.append(block["text"])
        elif kind in ("image", "document"):
            raise bad_request(f"{at}: {kind} blocks are not supported: the served model reads text only; send the "
                              "content as text", param=at)
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{at} must be {{\"type\": \"tool_use\", \"id\", \"name\", \"input\": {{...}}}}",
                                  param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id must be the id of the tool_use it answers", param=at)
            result = _result_text(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                result = "Error: " + result
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        else:
            raise bad_request(f"{at}: a {role} turn cannot hold a {kind!r} block (use text, tool_use in assistant "
                              "turns, tool_result in user turns)", param=at)
    if role == "user":
        return out + [{"role": "user", "content": "".join(text)}] if text or not out else out
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return [message]


def _result_text(content: Any, where: str) -> str:
    """A tool result's content as text: its text blocks, and a line for each block the model cannot read."""
    if not isinstance(content, list):
        return text_of_blocks(content, where)
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "tool_reference" and isinstance(block.get("tool_name"), str):
            parts.append(f"The tool {block['tool_name']} is available.")
        elif isinstance(kind, str):
            ignore(API, f"{kind!r} blocks in tool results", "the served model reads text only")
            parts.append(f"[{kind} left out: the model reads text only]")
        else:
            raise bad_request(f"{where}[{i}] must be a content block {{\"type\": \"text\", \"text\": ...}}",
                              param=f"{where}[{i}]")
    return "\n".join(parts)


def _tools(tools: Any, choice: Any) -> dict:
    """The chat fields of ``tools`` and ``tool_choice``."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object {{\"name\", \"description\", \"input_schema\"}}", param=where)
        if tool.get("type") not in (None, "custom"):
            ignore(API, f"server tools ({tool['type']!r}, ...)", "speculant runs no tools itself; the client runs its "
                   "own")
            continue
        out.append(tool_function(tool.get("name"), tool.get("description"), tool.get("input_schema"), where))
    chat: dict[str, Any] = {"tools": out} if out else {}
    if choice is None:
        return chat
    kind = _choice_type(choice)
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {\"type\": \"auto\"|\"any\"|\"tool\"|\"none\"}", param="tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("'tool_choice' {\"type\": \"tool\"} needs the tool's \"name\"", param="tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat


def tool_use_id(call_id: str) -> str:
    """The chat path's ``call_...`` id as Anthropic spells one."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(observer: Observer) -> dict:
    return {"input_tokens": observer.prompt_tokens - observer.cached_tokens,
            "output_tokens": observer.output_tokens,
            "cache_read_input_tokens": observer.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish: str | None, observer: Observer, chat: ChatPath, stops: list[str]) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    matched = chat.stop_of(observer, stops)
    if matched is not None:
        return "stop_sequence", matched
    return ("max_tokens" if observer.reason == "length" else "end_turn"), None


def message(answer: Answer, chat: ChatPath, model: str, stops: list[str]) -> dict:
    """The non-streamed response of a chat answer."""
    choice = answer.body["choices"][0]
    content: list[dict] = []
    for piece in pieces_of_message(choice["message"]):
        if piece[0] == "thinking":
            content.append({"type": "thinking", "thinking": piece[1], "signature": ""})
        elif piece[0] == "text":
            content.append({"type": "text", "text": piece[1]})
        elif piece[0] == "call":
            content.append({"type": "tool_use", "id": tool_use_id(piece[2]), "name": piece[3], "input": {}})
        else:
            content[-1]["input"] = arguments_object(piece[2])
    reason, sequence = stop_reason(choice["finish_reason"], answer.observer, chat, stops)
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(answer.observer)}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def events(chunks: Chunks, chat: ChatPath, model: str, stops: list[str]) -> AsyncIterator[str]:
    """Anthropic's stream of a streamed chat answer: one content block per thinking, text or call."""
    observer = chunks.observer
    start: dict[str, Any] = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
                             "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {"input_tokens": observer.prompt_tokens, "output_tokens": 0}}
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    index, open_kind, open_call, finish = -1, None, None, None
    try:
        async for chunk in paced(chunks.chunks):
            if chunk is None:  # quiet for a while: Anthropic's keep-alive
                yield _event("ping", {})
                continue
            if "error" in chunk:
                e = APIError(500, chunk["error"].get("message", "the request failed"))
                yield f"event: error\ndata: {json.dumps(error_body(e))}\n\n"
                return
            for choice in chunk.get("choices", ()):
                finish = choice.get("finish_reason") or finish
            for piece in pieces_of_delta(chunk):
                kind = piece[0]
                same = open_kind == kind or (open_kind == "call" and kind == "arguments" and open_call == piece[1])
                if not same:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index += 1
                    if kind == "call":
                        block = {"type": "tool_use", "id": tool_use_id(piece[2]), "name": piece[3], "input": {}}
                        open_kind, open_call = "call", piece[1]
                    else:
                        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                            else {"type": "text", "text": ""}
                        open_kind = kind
                    yield _event("content_block_start", {"index": index, "content_block": block})
                if kind == "text":
                    yield _event("content_block_delta",
                                 {"index": index, "delta": {"type": "text_delta", "text": piece[1]}})
                elif kind == "thinking":
                    yield _event("content_block_delta",
                                 {"index": index, "delta": {"type": "thinking_delta", "thinking": piece[1]}})
                elif kind == "arguments":
                    yield _event("content_block_delta",
                                 {"index": index, "delta": {"type": "input_json_delta", "partial_json": piece[2]}})
        if open_kind is not None:
            if open_kind == "thinking":
                yield _event("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                               "signature": ""}})
            yield _event("content_block_stop", {"index": index})
        reason, sequence = stop_reason(finish, observer, chat, stops)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage(observer)})
        yield _event("message_stop", {})
    except Exception as e:  # the headers are sent: the fault goes in the stream (logged)
        log.exception("stream failed")
        error = APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error")
        yield f"event: error\ndata: {json.dumps(error_body(error))}\n\n"
    finally:
        await chunks.chunks.aclose()


def add_messages_routes(app: FastAPI, chat: ChatPath) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on ``app``."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            body = await chat.body(request)
            chat_request, stops = chat_body(body, chat.model_id, chat.thinking_variables)
            answer = await chat.run(request, chat_request, cap_tokens=True)
        except APIError as e:
            return error_response(e)
        except Gone:
            return Response(status_code=499)
        model = body["model"]
        if isinstance(answer, Chunks):
            return StreamingResponse(events(answer, chat, model, stops), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return message(answer, chat, model, stops)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            body = await chat.body(request)
            chat_request, _ = chat_body(body, chat.model_id, chat.thinking_variables, count_only=True)
            return {"input_tokens": await chat.prompt_tokens(chat_request)}
        except APIError as e:
            return error_response(e)
