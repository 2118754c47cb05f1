"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked field by field.

Every field is checked here, with an error that names it and says what to send instead. A field
that would change the result and that speculant does not support (``n`` > 1, ``logprobs``,
``tools``, penalties, ``logit_bias``, a JSON ``response_format``, ...) is refused, never ignored;
so is a field this server does not know (a typo must not silently change nothing). Fields that do
not change the result (``user``, ``metadata``, ``store``, ``parallel_tool_calls`` without tools)
are accepted and ignored.

Before any field is read, the whole body is checked (``check_body``): it may be nested at most
``MAX_DEPTH`` levels, and every string in it, field names included, must be Unicode text (no
lone UTF-16 surrogate, which a ``\\uXXXX`` escape can smuggle into valid JSON) without NUL.
Numbers must be in range: a value no model could use is refused, never passed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..stopping import MAX_STOP_STRINGS
from ..text_check import text_problem
from .errors import bad_request

ROLES = ("system", "user", "assistant", "developer")  # "developer": OpenAI's newer name for system
# fields that do not change what is generated
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# fields that would change the result, and the value that means "off"
_OFF: dict[str, tuple] = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                          "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
                          "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                          "logit_bias": (None, {}), "echo": (None, False), "best_of": (None, 1),
                          "suffix": (None, ""), "modalities": (None, ["text"]), "audio": (None,),
                          "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n"}
FIELDS = {"chat": _COMMON | {"messages", "max_completion_tokens", "response_format"},
          "completion": _COMMON | {"prompt"}}
MAX_DEPTH = 64  # JSON nesting levels a body may have (a chat request with text parts needs 5)
MAX_INT32 = 2**31 - 1  # max_tokens and top_k: beyond any context or vocabulary
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as OpenAI documents it
MIN_TEMPERATURE = 1e-30  # the smallest temperature above 0 that sampling takes (config.SamplingConfig)


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request. ``prompt``: a string (completions) or chat messages (chat)."""
    kind: str  # "chat" | "completion"
    model: str
    prompt: str | tuple[dict, ...]
    max_tokens: int | None  # None: up to the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_request(body: Any, kind: str) -> CompletionRequest:
    """``body`` (the decoded JSON) as a CompletionRequest, or an APIError (400) naming the field."""
    check_body(body)
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type(body)}")
    unknown = sorted(set(body) - FIELDS[kind] - _IGNORED - set(_OFF))
    if unknown:
        raise bad_request(f"unknown field {show(unknown[0])}: speculant serve does not support it; remove it",
                          param=unknown[0], code="unsupported_parameter")
    for name, off in _OFF.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v for v in off):
            raise bad_request(f"{name!r} is not supported by speculant serve (it would change the result); "
                              f"remove it or set it to {off[-1]!r}", param=name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a model id from GET /v1/models", param="model")
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(f"'n' must be 1 (one choice per request), got {show(n)}", param="n",
                          code="unsupported_parameter")
    if kind == "chat":
        prompt: str | tuple[dict, ...] = _messages(body.get("messages"))
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported; remove it",
                              param="response_format", code="unsupported_parameter")
    else:
        prompt = _prompt(body.get("prompt"))
    max_tokens = _max_tokens(body, kind)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2 (0 = greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise bad_request(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (logits / temperature "
                          f"must stay finite), got {temperature:g}", param="temperature")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, "in (0, 1]")
    if top_p <= 0.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None else top_k
    if not _is_int(top_k) or not 0 <= top_k <= MAX_INT32:
        raise bad_request(f"'top_k' must be an integer from 0 (off) to {MAX_INT32}, got {show(top_k)}", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise bad_request(f"'seed' must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {show(seed)}",
                          param="seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'user' must be a string, got {_type(user)}", param="user")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, got {show(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad_request("'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed with \"stream\": true", param="stream_options")
    return CompletionRequest(kind, model, prompt, max_tokens, temperature, top_p, int(top_k), seed,
                             _stop(body.get("stop")), stream, bool(options and options.get("include_usage")))


def _messages(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param} must be an object with \"role\" and \"content\", got {_type(m)}", param=param)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role is {show(role)}: use one of {', '.join(ROLES)}", param=f"{param}.role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad_request(f"{param} has {show(sorted(extra)[0])}, which is not supported (no tool calls); "
                              "remove it", param=param, code="unsupported_parameter")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad_request(f"{param}.name must be a string, got {_type(m['name'])}", param=f"{param}.name")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), param)})
    return tuple(out)


def _content(content: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{param}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                  "supported", param=f"{param}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{param}.content must be a string, got {_type(content)}", param=f"{param}.content")


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request(f"'prompt' must be a string (one prompt per request), got {_type(prompt)}", param="prompt")
    if not prompt.strip():
        raise bad_request("'prompt' is empty: give some text to continue", param="prompt")
    return prompt


def _max_tokens(body: dict, kind: str) -> int | None:
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_INT32:
        raise bad_request(f"{name!r} must be an integer >= 1 (and within the model's context), got {show(value)}",
                          param=name)
    return int(value)


def _number(body: dict, name: str, default: float, lo: float, hi: float, what: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(f"{name!r} must be a number {what}, got {show(value)}", param=name)
    if not lo <= value <= hi:  # exact for integers of any size: no float conversion before this
        raise bad_request(f"{name!r} must be {what}, got {show(value)}", param=name)
    return float(value)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request(f"'stop' must be a string or a list of strings, got {_type(stop)}", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    if any(not s for s in stop):
        raise bad_request("'stop' has an empty string; remove it", param="stop")
    return tuple(stop)


def check_body(body: Any) -> None:
    """An APIError (400) if ``body`` is nested deeper than MAX_DEPTH or has a string (a value or
    a field name) that is not Unicode text or contains NUL; the message says where."""
    _check(body, (), 1)


def _check(value: Any, path: tuple, depth: int) -> None:
    if isinstance(value, str):
        problem = text_problem(value)
        if problem:
            where = where_is(path)
            raise bad_request(f"{where or 'the request body'} {problem}", param=where or None)
    elif isinstance(value, (dict, list)):
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body is nested deeper than {MAX_DEPTH} levels (at "
                              f"{show(where_is(path), 80)}): send a flatter body", param=where_is(path) or None)
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):  # numbers, booleans and null need no look
                    _check(item, path + (i,), depth + 1)
            return
        for key, item in value.items():
            problem = text_problem(key)
            if problem:
                where = where_is(path)
                raise bad_request(f"a field name in {where or 'the request body'} {problem}", param=where or None)
            _check(item, path + (key,), depth + 1)


def where_is(path: tuple) -> str:
    """A JSON path as a parameter name: ``messages[0].content``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages do not echo huge values."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "a very large integer"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)
