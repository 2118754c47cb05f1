"""OpenAI tool calling without a grammar engine: the request's ``tools`` are checked and rendered
through the model's own chat template, and the calls the model writes are parsed back out.

Request side (``check_tools``, ``check_tool_choice``, ``tool_calls_in``): ``tools`` is a list of
``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`` with
distinct names; ``tool_choice`` "auto" (the default with tools), "none" (the tools are not
rendered and the output is not parsed), "required" (one call or more, or exactly one with
``parallel_tool_calls`` false) or ``{"type": "function", "function": {"name": ...}}`` (exactly one
call of that function). The last two are kept by constrained decoding: ``call_grammar`` is the
grammar of the calls the template teaches (the tags, the function's name, its ``parameters`` as a
JSON schema, written as the template writes JSON: ``", "`` and ``": "``), which the decoder
enforces at every verified node like any ``response_format``.
An assistant message's ``tool_calls`` come back with their ``arguments`` (OpenAI's JSON string)
decoded into an object, which is what chat templates render (``tojson``). A function's definition
(``check_function``) and a call given back (``function_in``) are checked at a path the caller
names, so OpenAI's deprecated ``functions`` and ``function_call`` (``functions`` module) share
these checks.

Response side: a template's tool-call format is recognised from its text (``tool_format``):
"hermes" is the ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` form of
Qwen2.5, Hermes and others. ``ToolStream`` is the one parser: it takes the completion's text in
pieces, as it is generated, and returns OpenAI's deltas (``{"content": ...}``, ``{"tool_calls":
[...]}``). Text that may be the start of an opening tag is held back until it is resolved, as
stop strings hold text back; a call is sent once its closing tag has arrived and its body is a
JSON object with a string ``name`` and an object ``arguments``, as a delta with the id, type,
name and empty arguments, then one with the arguments. A malformed call (bad JSON, no closing
tag by the end) stays text. Whitespace between calls and around them is dropped once a call is
made; text with no well-formed call comes out exactly as generated. ``parse`` is the same machine
fed the whole text, so a streamed response adds up to the non-streamed one for every split.

Calls written without the tags: small models (Qwen2.5-Coder among them) often answer a request
with tools by writing the call as bare JSON, or as JSON in one Markdown code block, instead of the
tags their template teaches. With ``tool_choice`` "auto" (``names``: the request's tools), a
completion that is nothing but one or more objects ``{"name": <one of the request's tools>,
"arguments": {...}}``, bare or in one ```` ```json ```` block, is read as those calls. Nothing else
is: one character of other text, a name the request did not declare, or malformed JSON leaves the
completion as text. A completion that begins (after whitespace) with ``{`` or a backtick is held
back until it is decided (in the worst case to its end), as a tag's beginning is.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .errors import bad_request

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
HERMES = ("<tool_call>", "</tool_call>")


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def check_tools(tools: Any) -> tuple[dict, ...] | None:
    """``tools`` as given (None or [] : no tools), or a 400 naming the field at fault."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, "
                          f"got {_kind(tools)}", param="tools")
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got "
                              f"{_kind(tool)}", param=where)
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise bad_request(f"{where} has {extra[0]!r}: a tool has only \"type\" and \"function\"", param=where)
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type must be \"function\" (the only kind of tool), got "
                              f"{tool.get('type')!r}"[:200], param=f"{where}.type")
        out.append({"type": "function", "function": check_function(tool.get("function"), f"{where}.function", names)})
    return tuple(out)


def check_function(fn: Any, where: str, names: set[str]) -> dict:
    """One function definition, ``{"name", "description"?, "parameters"?, "strict"?}``, at ``where``
    (``tools[0].function``, or ``functions[0]`` in the deprecated API), its name added to ``names``
    (which must not have it yet); without its null fields, or a 400 naming the field at fault."""
    if not isinstance(fn, dict):
        raise bad_request(f"{where} must be an object with \"name\" (and \"description\", \"parameters\"), got "
                          f"{_kind(fn)}", param=where)
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise bad_request(f"{where} has {extra[0]!r}: use \"name\", \"description\", \"parameters\", \"strict\"",
                          param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"[:200],
                          param=f"{where}.name")
    if name in names:
        raise bad_request(f"{where}.name {name!r} is used by another function: names must be distinct",
                          param=f"{where}.name")
    names.add(name)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{where}.description must be a string, got {_kind(fn['description'])}",
                          param=f"{where}.description")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise bad_request(f"{where}.parameters must be a JSON schema object with \"type\": \"object\" (e.g. "
                          f"{{\"type\": \"object\", \"properties\": {{...}}}}), got {_kind(params)}",
                          param=f"{where}.parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_request(f"{where}.strict must be true or false", param=f"{where}.strict")
    return {k: v for k, v in fn.items() if v is not None}


def bare_call_names(tools: tuple[dict, ...] | None, choice: str) -> tuple[str, ...]:
    """The tools whose calls a completion may write without tags: all of them with tool_choice
    "auto" (module doc), none otherwise (the grammar of "required" and a named call writes the tags)."""
    return tuple(t["function"]["name"] for t in tools) if tools and choice == "auto" else ()


def check_tool_choice(choice: Any, tools: tuple[dict, ...] | None) -> tuple[str, str | None]:
    """``tool_choice`` as (mode, function name): ("auto" | "none" | "required", None) or
    ("function", name); a 400 naming the field for anything else."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none"):
        return (choice if tools else "none"), None
    if choice == "required":
        if not tools:
            raise bad_request("'tool_choice' \"required\" needs 'tools'", param="tool_choice")
        return "required", None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or set(choice) - {"type", "function"} \
                or set(fn) - {"name"}:
            raise bad_request("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param="tool_choice")
        known = [t["function"]["name"] for t in tools or ()]
        if name not in known:
            raise bad_request(f"'tool_choice' names the function {name!r}"[:200] + ", which is not in 'tools'",
                              param="tool_choice.function.name")
        return "function", name
    raise bad_request(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {_kind(choice)}", param="tool_choice")


def call_grammar(tools: tuple[dict, ...], tokenizer: Any, name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar (llguidance's dialect: ``%json`` embeds a JSON schema, ``<[id]>`` is a
    token) of Hermes tool calls: exactly one call of ``name``; or, with ``name`` None, one call of
    any of ``tools`` and, with ``parallel``, more, one per line. A call is the opening tag, a
    newline, ``{"name": <a tool's name>, "arguments": <an object its parameters' schema
    allows>}``, a newline and the closing tag; the tags are the tokenizer's own tokens where it
    has them. Keywords of a parameters schema the engine does not implement are ignored unless
    every tool says ``strict``."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = [{"type": "object",
              "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for fn in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                       "lenient": not all(fn.get("strict") for fn in chosen)}}
    opening, closing = (_literal(tokenizer, tag) for tag in HERMES)
    call = f'{opening} "\\n" %json {json.dumps(schema)} "\\n" {closing}'
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    return f"start: call{repeat}\ncall: {call}\n"


def _literal(tokenizer: Any, text: str) -> str:
    """``text`` in a grammar: its token (``<[id]>``) where the tokenizer has it as one added token
    (the engine matches added tokens only as tokens), else the quoted string."""
    if text in tokenizer.get_added_vocab():
        return f"<[{tokenizer.convert_tokens_to_ids(text)}]>"
    return json.dumps(text)


def tool_calls_in(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` for the chat template: ``arguments`` (a JSON string
    of an object) decoded. A 400 naming the field if a call is not OpenAI's shape."""
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"{where} must be a non-empty list of {{\"id\", \"type\": \"function\", \"function\": "
                          "{\"name\", \"arguments\"}} objects", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise bad_request(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}", param=at)
        if not isinstance(call.get("id"), str):
            raise bad_request(f"{at}.id must be a string", param=f"{at}.id")
        out.append({"id": call["id"], "type": "function", "function": function_in(call.get("function"),
                                                                                 f"{at}.function")})
    return out


def function_in(fn: Any, where: str) -> dict:
    """A call's ``{"name", "arguments"}`` given back (at ``where``) for the chat template:
    ``arguments`` (a JSON string of an object, "{}" when absent) decoded; a 400 naming the field
    if it is not that shape."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{\"name\": string, \"arguments\": JSON string}}", param=where)
    args = fn.get("arguments", "{}")
    try:
        decoded = json.loads(args) if isinstance(args, str) else None
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise bad_request(f"{where}.arguments must be a JSON object written as a string, e.g. "
                          "'{\"city\": \"Paris\"}'", param=f"{where}.arguments")
    return {"name": fn["name"], "arguments": decoded}


def tool_format(tokenizer: Any) -> str | None:
    """The tool-call format the tokenizer's chat template teaches the model ("hermes"), "unknown"
    for a template that renders tools in a format this module cannot parse, None for one that
    does not render tools at all."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or any that renders tools
        template = template.get("tool_use") or template.get("default") or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    return "hermes" if HERMES[0] in template and HERMES[1] in template else "unknown"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a well-formed call's body, else None."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(value)


def _call_of(value: Any) -> tuple[str, str] | None:
    """:func:`_call` of a decoded body."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.S)
_UNDECIDED, _NOT_BARE = "undecided", "not bare"


def bare_calls(text: str, names: frozenset[str], final: bool) -> list[tuple[str, str]] | str:
    """What ``text`` (a completion's beginning, or with ``final`` all of it) is as calls written
    without tags (module doc): their (name, arguments) when it is wholly such calls, ``_NOT_BARE``
    when it cannot be, ``_UNDECIDED`` when more text may still make it so."""
    s = text.strip()
    if not s:
        return _NOT_BARE if final else _UNDECIDED
    if s[0] not in "{`":
        return _NOT_BARE
    fenced = _FENCED.fullmatch(s)
    if s[0] == "`":
        if fenced is None:
            return _NOT_BARE if final or not s.startswith("```"[:len(s)]) else _UNDECIDED
        s = fenced.group(1).strip()
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(s):
        try:
            value, end = decoder.raw_decode(s, at)
        except json.JSONDecodeError:
            return _NOT_BARE if final else _UNDECIDED  # malformed, or not written to its end yet
        call = _call_of(value)
        if call is None or call[0] not in names:
            return _NOT_BARE
        calls.append(call)
        at = end
        while at < len(s) and s[at].isspace():
            at += 1
    if not calls:
        return _NOT_BARE
    return calls if final else _UNDECIDED


class ToolStream:
    """The parser of one completion (module doc): ``feed(text)`` and then ``finish()`` return
    OpenAI deltas; ``calls`` counts the calls sent. ``ids``: a call's id from its index (default
    ``call_<random hex>``). ``names``: the request's tools whose calls may come without tags
    (tool_choice "auto"; empty: only tagged calls are read)."""

    def __init__(self, fmt: str = "hermes", ids=None, names=()):
        if fmt != "hermes":
            raise ValueError(f"no parser for the tool-call format {fmt!r}")
        self.open, self.close = HERMES
        self.ids = ids or (lambda index: "call_" + uuid.uuid4().hex[:24])
        self.calls = 0
        self._names = frozenset(names)
        self._held: str | None = "" if self._names else None  # a completion that may be bare calls (None: decided)
        self._text = ""  # not yet sent, outside a call: trailing whitespace, a possible tag beginning
        self._body: str | None = None  # inside a call: its body so far (None: outside)
        self._blank = ""  # the whitespace before the current call's opening tag
        self._after = False  # right after a call: leading whitespace is dropped

    def feed(self, text: str) -> list[dict]:
        if self._held is not None:
            self._held += text
            if bare_calls(self._held, self._names, final=False) == _UNDECIDED:
                return []
            text, self._held = self._held, None
        return self._parse(text)

    def _parse(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._text += text
        while True:
            if self._body is None:
                at = self._text.find(self.open)
                if at < 0:  # send all but trailing whitespace and a possible beginning of the tag
                    keep = _partial_suffix(self._text, self.open)
                    ready = self._text[:len(self._text) - keep]
                    sent = self._send(out, ready.rstrip())
                    self._text = self._text[sent:]
                    return out
                before = self._text[:at]
                sent = self._send(out, before.rstrip())
                self._blank = before[sent:]
                self._body, self._text = "", self._text[at + len(self.open):]
            else:
                self._body += self._text
                self._text = ""
                at = self._body.find(self.close)
                if at < 0:
                    return out
                body, rest = self._body[:at], self._body[at + len(self.close):]
                self._body = None
                call = _call(body)
                if call is None:  # malformed: the tag and its body are text
                    self._send(out, self._blank + self.open + body + self.close)
                else:
                    self._emit(out, *call)
                self._blank = ""
                self._text = rest

    def _emit(self, out: list[dict], name: str, args: str) -> None:
        """A call's two deltas: its id, type and name, then its arguments."""
        index = self.calls
        self.calls += 1
        out.append({"tool_calls": [{"index": index, "id": self.ids(index), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
        self._after = True

    def finish(self) -> list[dict]:
        """The deltas of what is still held: bare calls, or an unclosed call and any held text, as text."""
        if self._held is not None:
            held, self._held = self._held, None
            calls = bare_calls(held, self._names, final=True)
            if isinstance(calls, list):
                out: list[dict] = []
                for call in calls:
                    self._emit(out, *call)
                return out
            out = self._parse(held)
            return out + self.finish()
        out = []
        rest = self._text if self._body is None else self._blank + self.open + self._body + self._text
        self._text, self._body, self._blank = "", None, ""
        self._send(out, rest.rstrip() if self.calls else rest)
        return out

    def _send(self, out: list[dict], text: str) -> int:
        """Send ``text`` (its leading whitespace dropped right after a call); returns how many
        characters of it were consumed."""
        n = len(text)
        if self._after:
            text = text.lstrip()
        if text:
            out.append({"content": text})
            self._after = False
        return n


def parse(text: str, fmt: str = "hermes", ids=None, names=()) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole completion: the calls in OpenAI's message shape, the
    content the text outside them (None if there are calls and no other text). ``names`` as for
    :class:`ToolStream`."""
    stream = ToolStream(fmt, ids, names)
    content, calls = join(stream.feed(text) + stream.finish())
    return content, calls


def join(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """Deltas added up: (content, tool_calls) as a non-streamed message has them."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            if "id" in c:
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if calls and not content:
        return None, calls
    return content, calls
