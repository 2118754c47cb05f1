"""OpenAI's deprecated function calling, mapped onto tool calling (``tools``): older agent
frameworks and clients still send it.

Request side: ``functions`` is a list of function definitions, each what a tool's ``function``
is (``tools.check_function``), so it becomes ``tools`` of type function; ``function_call`` "none",
"auto" or ``{"name": ...}`` becomes ``tool_choice`` "none", "auto" or that named function (the
deprecated API has no "required"); without it, "auto" with functions. ``functions`` beside
``tools``, or ``function_call`` beside ``tools`` or ``tool_choice``, is a 400: one request speaks
one of the two. An empty ``functions`` list declares nothing, as an empty ``tools`` list.

In the history, an assistant message's ``function_call: {"name", "arguments"}`` becomes a tool
call and a ``function`` message (``name`` and ``content``: the function's result) a ``tool``
message, so the chat template renders both as it renders tool calls and results. The deprecated
API has no call ids: a call gets ``call_<i>`` (i its message's index) and a result the id of the
latest call of the same function before it.

Response side (``as_function_call``, ``function_call_message``): the calls parsed out of the text
(``tools.ToolStream``) come back in the deprecated shape, ``message.function_call = {"name",
"arguments"}`` with ``finish_reason`` "function_call", streamed as a delta ``{"function_call":
{"name", "arguments": ""}}`` and then ``{"function_call": {"arguments": ...}}``. The deprecated
API has one call per message: a completion with several keeps the first.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request, kind_of, show
from .tools import check_function, check_tool_choice, function_in, tool_calls_in

CHOICE_SHAPE = "\"none\", \"auto\" or {\"name\": <one of 'functions'>}"


def legacy_tools(body: dict) -> tuple[tuple[dict, ...] | None, str, str | None] | None:
    """A chat request's ``functions`` and ``function_call`` as (tools, tool_choice mode, function
    name), as ``tools.check_tool_choice`` gives them; None when the request uses neither (its
    ``tools`` and ``tool_choice`` apply). A 400 naming the field at fault."""
    functions, choice = body.get("functions"), body.get("function_call")
    if (functions is None or functions == []) and choice is None:
        return None
    if functions is not None and functions != [] and body.get("tools") not in (None, []):
        raise bad_request("'functions' cannot be combined with 'tools': send the tools in 'tools' (with "
                          "'tool_choice') or, in the deprecated form, in 'functions' (with 'function_call')",
                          param="functions")
    if choice is not None and (body.get("tools") not in (None, []) or body.get("tool_choice") is not None):
        raise bad_request("'function_call' goes with the deprecated 'functions': with 'tools' send 'tool_choice'",
                          param="function_call")
    tools = check_functions(functions)
    return (tools, *function_choice(choice, tools))


def check_functions(functions: Any) -> tuple[dict, ...] | None:
    """``functions`` as tools of type function (None for none), or a 400 naming the field."""
    if functions is None or functions == []:
        return None
    if not isinstance(functions, list):
        raise bad_request(f"'functions' must be a list of {{\"name\", \"description\", \"parameters\"}} objects, "
                          f"got {kind_of(functions)}", param="functions")
    names: set[str] = set()
    return tuple({"type": "function", "function": check_function(fn, f"functions[{i}]", names)}
                 for i, fn in enumerate(functions))


def function_choice(choice: Any, tools: tuple[dict, ...] | None) -> tuple[str, str | None]:
    """``function_call`` as ``tool_choice``'s (mode, function name)."""
    if choice is None or choice in ("none", "auto"):
        return check_tool_choice(choice, tools)
    if isinstance(choice, dict) and set(choice) == {"name"} and isinstance(choice["name"], str):
        known = [t["function"]["name"] for t in tools or ()]
        if choice["name"] not in known:
            raise bad_request(f"'function_call' names the function {show(choice['name'])}, which is not in "
                              "'functions'", param="function_call.name")
        return "function", choice["name"]
    hint = "; to make the model call one of several, send 'tools' with 'tool_choice' \"required\"" \
        if choice == "required" else ""
    raise bad_request(f"'function_call' must be {CHOICE_SHAPE}, got {show(choice)}{hint}", param="function_call")


def call_id(index: int) -> str:
    """The id of the call in message ``index`` of a history in the deprecated form (it has none)."""
    return f"call_{index}"


def assistant_calls(m: dict, where: str, index: int) -> list[dict] | None:
    """An assistant message's calls for the chat template: its ``tool_calls``, or its deprecated
    ``function_call`` as one tool call; None for neither; a 400 naming the field at fault."""
    calls, call = m.get("tool_calls"), m.get("function_call")
    if call is not None and calls is not None:
        raise bad_request(f"{where} has both 'tool_calls' and 'function_call': send its calls in one of them",
                          param=f"{where}.function_call")
    if calls is not None:
        return tool_calls_in(calls, f"{where}.tool_calls")
    if call is None:
        return None
    at = f"{where}.function_call"
    if not isinstance(call, dict) or set(call) - {"name", "arguments"}:
        raise bad_request(f"{at} must be {{\"name\": string, \"arguments\": JSON string}}, got {show(call)}",
                          param=at)
    if not isinstance(call.get("name"), str) or not call["name"]:
        raise bad_request(f"{at}.name must be the name of the function called, got {show(call.get('name'))}",
                          param=f"{at}.name")
    return [{"id": call_id(index), "type": "function", "function": function_in(call, at)}]


def function_result(m: dict, where: str, index: int, before: list[dict]) -> dict:
    """A ``function`` message's fields as a ``tool`` message's (``role``, ``name``,
    ``tool_call_id``; its content is read as any message's): ``before`` are the messages before
    it, already converted, where the call it answers is looked for."""
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be the name of the function whose result this message is, got "
                          f"{show(name)}", param=f"{where}.name")
    ids = [c["id"] for message in before for c in message.get("tool_calls", ()) if c["function"]["name"] == name]
    return {"role": "tool", "name": name, "tool_call_id": ids[-1] if ids else call_id(index)}


def as_function_call(deltas: list[dict]) -> list[dict]:
    """``ToolStream`` deltas in the deprecated shape: the first call's name (with empty
    arguments), then its arguments, as ``function_call`` deltas; later calls dropped; text as it is."""
    out = []
    for delta in deltas:
        if "tool_calls" not in delta:
            out.append(delta)
            continue
        for call in delta["tool_calls"]:
            if call["index"] != 0:
                continue
            fn = call["function"]
            out.append({"function_call": {"name": fn["name"], "arguments": ""}} if "id" in call
                       else {"function_call": {"arguments": fn["arguments"]}})
    return out


def function_call_message(message: dict, calls: list[dict]) -> None:
    """Put the first of ``calls`` (OpenAI's tool-call shape) in ``message`` as its ``function_call``."""
    fn = calls[0]["function"]
    message["function_call"] = {"name": fn["name"], "arguments": fn["arguments"]}


def calls_finish(reason: str, functions: bool) -> str:
    """The finish reason of a choice with calls: "tool_calls" ("function_call" in the deprecated
    form), unless it was cut short."""
    return reason if reason == "length" else "function_call" if functions else "tool_calls"
