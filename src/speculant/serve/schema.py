"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked field by field.

Every field is checked here, with an error that names it and says what to send instead. Besides
the basics (``model``, ``messages`` / ``prompt``, ``max_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop``, ``stream``) the server honours OpenAI's ``presence_penalty``,
``frequency_penalty`` (-2..2), ``logit_bias`` ({"token id": -100..100}) and ``logprobs`` (chat:
true, with ``top_logprobs`` 0..20; completions: the number of top tokens, 0..20), and the
extensions ``top_k``, ``min_p`` ([0, 1)), ``repetition_penalty`` (> 0, 1 off) and
``cache_prompt`` (llama-server's: true by default; false keeps the request out of the prefix
cache, neither reading nor writing it) and ``speculative`` (false: plain decoding for this
request; ``{"max_depth": k}``: drafts at most k tokens deep; the output is the same either way;
``"sources": true``: each streamed token's chunk
names its source, "draft" or "target"). ``echo`` (completions): the prompt comes back before
the completion, with ``logprobs`` its tokens' too (the first one's null), and ``max_tokens`` 0 then
only scores the prompt. The completions ``prompt`` in every form OpenAI takes (one string, a list
of strings, token ids, lists of token ids), its ``suffix`` (fill in the middle) and the
``prediction`` of both endpoints (Predicted Outputs) are checked by ``inputs``. A field that
would change the result and that speculant does not support (``best_of``, ``audio``, ...) is
refused, never ignored; so is a field this server does not know (a typo must not silently change
nothing). Fields that do not change the result (``user``, ``metadata``, ``store``) are accepted
and ignored. ``response_format`` (OpenAI's ``text``, ``json_object``, ``json_schema``, and the
extensions ``regex`` and ``grammar``, on both endpoints) is checked by
``constraints.parse_response_format``; a grammar that does not compile is refused when the
request starts. ``tools``, ``tool_choice`` ("auto", "none", "required", a named function) and
``parallel_tool_calls``, and messages carrying tool calls and their results (an assistant's
``tool_calls``, the ``tool`` role), are checked by ``tools``; OpenAI's deprecated ``functions``,
``function_call`` and ``function`` role are mapped onto them by ``functions``. Whether the model's
chat template can render them is checked by the app. ``chat_template_kwargs`` and
``reasoning_effort`` (chat) are checked by ``reasoning``, and whether the model's chat template
reads them by the app. Whether ``logit_bias``'s token ids are in the model's vocabulary is checked
by the app, which knows the model.

Before any field is read, the whole body is checked (``check_body``): it may be nested at most
``MAX_DEPTH`` levels, and every string in it, field names included, must be Unicode text (no
lone UTF-16 surrogate, which a ``\\uXXXX`` escape can smuggle into valid JSON) without NUL.
Numbers must be in range: a value no model could use is refused, never passed on.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ..constraints import parse_response_format
from ..errors import ConfigError
from ..penalties import MAX_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY
from ..stopping import MAX_STOP_STRINGS
from ..text_check import text_problem
from .errors import bad_request, is_int as _is_int, kind_of as _type, show
from .inputs import completion_prompts, prediction_of, suffix_of
from .functions import assistant_calls, function_result, legacy_tools
from .reasoning import given_thinking, template_variables
from .tools import check_tool_choice, check_tools

# "developer": OpenAI's newer name for system; "function": a function's result (deprecated: "tool")
ROLES = ("system", "user", "assistant", "developer", "tool", "function")
# fields that do not change what is generated
_IGNORED = {"user", "metadata", "store", "service_tier"}
# fields that would change the result, and the value that means "off"
_OFF: dict[str, tuple] = {"echo": (None, False), "best_of": (None, 1),
                          "modalities": (None, ["text"]), "audio": (None,),
                          "reasoning_effort": (None,), "web_search_options": (None,)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
           "repetition_penalty", "min_p", "response_format", "speculative", "prediction", "cache_prompt"}
FIELDS = {"chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                             "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs",
                             "reasoning_effort"},
          # top_logprobs: refused with a hint (_logprobs)
          "completion": _COMMON | {"prompt", "top_logprobs", "echo", "suffix"}}
# beyond role, content, name
_TOOL_KEYS = {"assistant": {"tool_calls", "function_call", "reasoning_content"}, "tool": {"tool_call_id"}}
_EMPTY_OK = {"refusal", "audio", "annotations"}  # an assistant message the client gave back
MAX_DEPTH = 64  # JSON nesting levels a body may have (a chat request with text parts needs 5)
MAX_INT32 = 2**31 - 1  # max_tokens and top_k: beyond any context or vocabulary
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as OpenAI documents it
MIN_TEMPERATURE = 1e-30  # the smallest temperature above 0 that sampling takes (config.SamplingConfig)
MAX_TOP_LOGPROBS = 20  # top tokens reported per position, as OpenAI's chat API (api.MAX_TOP_LOGPROBS)
MAX_DRAFT_DEPTH = 64  # the extension speculative.max_depth's bound
MAX_N = 16  # choices per request (each one a generation of the batch)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (each one is applied at every verified node)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id, as a string of decimal digits


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request. ``prompt``: a string or token ids (completions: its first prompt,
    ``prompts`` has them all) or chat messages (chat)."""
    kind: str  # "chat" | "completion"
    model: str
    prompt: str | tuple[int, ...] | tuple[dict, ...]
    max_tokens: int | None  # None: up to the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k at its position
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    tools: tuple[dict, ...] | None = None  # the tools to render and parse calls of (None: none, or tool_choice "none")
    tool_choice: str = "none"  # "auto" | "none" | "required" | "function" (a call of tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # with tool_choice "required": more than one call allowed
    response_format: dict | None = None  # checked (constraints.parse_response_format); None: plain text
    n: int = 1  # choices: n generations, seeds seed, seed + 1, ...
    max_draft_depth: int | None = None  # the extension "speculative": None: the server's drafts; 0: plain decoding
    token_sources: bool = False  # the extension speculative.sources: each streamed token says where it came from
    echo: bool = False  # completions: the prompt comes back before the completion (with logprobs: its tokens' too)
    prompts: tuple = ()  # completions: every prompt (a string or token ids), one choice (or n) each, in order
    suffix: str | None = None  # fill in the middle between each prompt and this (None: a plain continuation)
    middle: str = ""  # fill in the middle: the start of the middle, already written (/infill's prompt)
    repository: tuple[tuple[str, str], ...] = ()  # fill in the middle: other files (name, text), as context
    prediction: str | None = None  # the text the output is expected to be (Predicted Outputs), drafted from
    functions: bool = False  # the tools came as the deprecated functions: a call comes back as function_call
    template_variables: dict = dataclasses.field(default_factory=dict)  # chat: extra chat-template variables
    reasoning_effort: str | None = None  # chat: as asked (its enable_thinking is in template_variables)
    cache_prompt: bool = True  # llama-server's: False keeps this request out of the prefix cache (reads and writes)


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
        if name in FIELDS[kind]:  # echo: a field of the completions endpoint only
            continue
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v for v in off):
            other = "completion" if kind == "chat" else "chat"
            hint = f"; it is a field of /v1/{'chat/' if other == 'chat' else ''}completions" \
                if name in FIELDS[other] else ""
            raise bad_request(f"{name!r} is not supported by speculant serve (it would change the result); "
                              f"remove it or set it to {off[-1]!r}{hint}", param=name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a model id from GET /v1/models", param="model")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer from 1 to {MAX_N} (the choices to generate), got {show(n)}",
                          param="n")
    tools, choice, tool_name, parallel, functions = None, "none", None, True, False
    variables, effort = template_variables(body) if kind == "chat" else ({}, None)
    fmt = _response_format(body.get("response_format"))
    if kind == "chat":
        prompt: str | tuple[int, ...] | tuple[dict, ...] = _messages(body.get("messages"))
        legacy = legacy_tools(body)  # the deprecated functions / function_call, as tools
        if legacy is None:
            tools = check_tools(body.get("tools"))
            choice, tool_name = check_tool_choice(body.get("tool_choice"), tools)
        else:
            tools, choice, tool_name = legacy
            functions = tools is not None
        if choice == "none":
            tools = None
        parallel = body.get("parallel_tool_calls")
        parallel = True if parallel is None else parallel
        if not isinstance(parallel, bool):
            raise bad_request(f"'parallel_tool_calls' must be true or false, got {show(parallel)}",
                              param="parallel_tool_calls")
        if choice in ("required", "function") and fmt is not None:
            field = "tool_choice" if legacy is None else "function_call"
            raise bad_request(f"'response_format' cannot be combined with {field!r} {show(body[field])}: "
                              "the output is then a tool call; send one of them", param="response_format")
    echo = body.get("echo", False) if kind == "completion" else False
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise bad_request(f"'echo' must be true or false, got {show(echo)}", param="echo")
    prompts, suffix = (), None
    if kind == "completion":
        prompts = completion_prompts(body.get("prompt"))
        prompt = prompts[0]
        suffix = suffix_of(body, prompts, echo)
    prediction = prediction_of(body.get("prediction"))
    max_tokens = _max_tokens(body, kind, zero_ok=echo)
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2 (0 = greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise bad_request(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (logits / temperature "
                          f"must stay finite), got {temperature:g}", param="temperature")
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0, "in (0, 1]")
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
    min_p = number_field(body, "min_p", 0.0, 0.0, 1.0, "in [0, 1) (0 = off)")
    if min_p >= 1.0:
        raise bad_request(f"'min_p' must be in [0, 1) (0 = off), got {show(body['min_p'])}", param="min_p")
    between = f"between -{MAX_PENALTY:g} and {MAX_PENALTY:g} (0 = off)"
    presence = number_field(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, between)
    frequency = number_field(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, between)
    repetition = number_field(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY,
                         f"above 0 and at most {MAX_REPETITION_PENALTY:g} (1 = off)")
    if repetition <= 0.0:
        raise bad_request(f"'repetition_penalty' must be above 0 and at most {MAX_REPETITION_PENALTY:g} (1 = off), "
                          f"got {show(body['repetition_penalty'])}", param="repetition_penalty")
    return CompletionRequest(kind, model, prompt, max_tokens, temperature, top_p, int(top_k), seed,
                             stop_field(body.get("stop")), stream, bool(options and options.get("include_usage")),
                             _logprobs(body, kind), min_p, presence, frequency, repetition,
                             _logit_bias(body.get("logit_bias")), tools, choice, tool_name, parallel, fmt, int(n),
                             *speculative_field(body.get("speculative")), echo=echo, prompts=prompts, suffix=suffix,
                             prediction=prediction, functions=functions, template_variables=variables,
                             reasoning_effort=effort, cache_prompt=flag_field(body, "cache_prompt", True))


def flag_field(body: dict, name: str, default: bool) -> bool:
    """A true-or-false field (null or absent: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {show(value)}", param=name)
    return value


def speculative_field(value: Any) -> tuple[int | None, bool]:
    """The extension ``speculative``: true or absent (the server's speculation), false (plain
    decoding for this request) or ``{"max_depth": k, "sources": bool}`` (drafts at most k tokens
    deep, 0 to MAX_DRAFT_DEPTH; ``sources``: every streamed token's chunk says whether it was an
    accepted draft or the target's own). As (the decoder's max_draft_depth, sources)."""
    if value is None or value is True:
        return None, False
    if value is False:
        return 0, False
    if not isinstance(value, dict) or set(value) - {"max_depth", "sources"}:
        raise bad_request(f"'speculative' must be true, false or {{\"max_depth\": k, \"sources\": true|false}}, "
                          f"got {show(value)}", param="speculative")
    depth, sources = value.get("max_depth"), value.get("sources", False)
    if depth is not None and not (_is_int(depth) and 0 <= depth <= MAX_DRAFT_DEPTH):
        raise bad_request(f"'speculative.max_depth' must be an integer from 0 (plain decoding) to {MAX_DRAFT_DEPTH}, "
                          f"got {show(depth)}", param="speculative.max_depth")
    if not isinstance(sources, bool):
        raise bad_request(f"'speculative.sources' must be true or false, got {show(sources)}",
                          param="speculative.sources")
    return (None if depth is None else int(depth)), sources


def _response_format(fmt: Any) -> dict | None:
    """``response_format`` checked (a 400 saying what is wrong); None for plain text."""
    try:
        spec = parse_response_format(fmt)
    except ConfigError as e:
        raise bad_request(str(e), param="response_format") from None
    return None if spec is None else fmt


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top tokens to report at each position (None: no logprobs). Chat: ``logprobs``
    true|false and ``top_logprobs`` (only with logprobs true, as OpenAI has it); completions:
    ``logprobs`` is the number itself (OpenAI's legacy API allows up to 5; this server 20)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if top is not None and not (_is_int(top) and top == 0):  # 0 asks for nothing: accepted, as before
            raise bad_request("'top_logprobs' is a chat field: on /v1/completions send 'logprobs': k for the top k "
                              f"tokens (0 to {MAX_TOP_LOGPROBS})", param="top_logprobs")
        if value is None or value is False:
            return None
        if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} (the top tokens reported "
                              f"at each position) or null, got {show(value)}", param="logprobs")
        return int(value)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'logprobs' must be true or false, got {show(value)}", param="logprobs")
    if top is None:
        return 0 if value else None
    if not value:
        raise bad_request("'top_logprobs' is only allowed with \"logprobs\": true", param="top_logprobs")
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {show(top)}",
                          param="top_logprobs")
    return int(top)


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (strings of digits, as JSON keys are) to biases in
    [-100, 100]; as (id, bias) pairs, ids ascending."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_request(f"'logit_bias' must be an object of token ids to biases, e.g. {{\"42\": -100}}, got "
                          f"{_type(bias)}", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                          param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) > MAX_INT32:
            raise bad_request(f"'logit_bias' keys must be token ids (integers from 0, written as strings), got "
                              f"{show(key)}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise bad_request(f"'logit_bias' values must be numbers from -{MAX_BIAS:g} to {MAX_BIAS:g}, got "
                              f"{show(value)} for token "
                              f"{key}", param="logit_bias")  # NaN fails the range; JSON has no infinity
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


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
        allowed = {"role", "content", "name"} | _TOOL_KEYS.get(role, set())
        extra = {k for k in set(m) - allowed if not (role == "assistant" and k in _EMPTY_OK and not m[k])}
        if extra:
            raise bad_request(f"{param} has {show(sorted(extra)[0])}, which a {role} message does not take; "
                              "remove it", param=param, code="unsupported_parameter")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad_request(f"{param}.name must be a string, got {_type(m['name'])}", param=f"{param}.name")
        message: dict = {"role": "system" if role == "developer" else role}
        calls = assistant_calls(m, param, i) if role == "assistant" else None
        if calls is not None:  # content may be null beside calls
            message["tool_calls"] = calls
            message["content"] = "" if m.get("content") is None else _content(m["content"], param)
        elif role == "function":  # a function's result, as a tool message; its content may be null
            message.update(function_result(m, param, i, out))
            message["content"] = "" if m.get("content") is None else _content(m["content"], param)
        else:
            message["content"] = _content(m.get("content"), param)
        if role == "assistant" and (thought := given_thinking(m, param)) is not None:
            message["reasoning_content"] = thought
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise bad_request(f"{param}.tool_call_id must be the id of the call this message answers",
                                  param=f"{param}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
            if m.get("name") is not None:
                message["name"] = m["name"]
        out.append(message)
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


def _max_tokens(body: dict, kind: str, zero_ok: bool = False) -> int | None:
    """The request's token limit; 0 only with ``zero_ok`` (echo: the prompt scored, nothing generated)."""
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not (0 if zero_ok else 1) <= value <= MAX_INT32:
        hint = " (0 only with \"echo\": true, to score the prompt)" if kind == "completion" and not zero_ok else ""
        raise bad_request(f"{name!r} must be an integer >= {0 if zero_ok else 1}{hint} (and within the model's "
                          f"context), got {show(value)}", param=name)
    return int(value)


def number_field(body: dict, name: str, default: float, lo: float, hi: float, what: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(f"{name!r} must be a number {what}, got {show(value)}", param=name)
    if not lo <= value <= hi:  # exact for integers of any size: no float conversion before this
        raise bad_request(f"{name!r} must be {what}, got {show(value)}", param=name)
    return float(value)


def stop_field(stop: Any) -> tuple[str, ...]:
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
