"""Multi-turn sessions for ``speculant bench --sessions``: the file, its checks, and each turn's request.

A sessions file is JSON Lines, one session per line::

    {"id": str, "kind": "chat" | "coding" | "agent" | "mt_bench", "system": str | null,
     "tools": [OpenAI function tools] | null, "turns": [str, ...], "source": str, "licence": str}

``turns`` are the user's messages, in order; the assistant's side of the conversation is whatever
the server under test answers, so a session is replayed the way a chat front end, an editor or an
agent drives a server: every turn resends the whole history. Turn k's messages
(:func:`turn_messages`) are the system message (when ``system`` is not null), then for each earlier
turn j the user's message j and the server's answer j (:class:`Answer`: its text as the assistant's
``content``, its ``tool_calls`` if it made any, then one ``tool`` message per call with
:data:`TOOL_RESULT`: the bench runs no tools, the next user turn says what they gave), then the
user's message k. ``tools`` go with every request of the session (``tool_choice`` left at "auto").

The shipped file (``DEFAULT_FILE``, chosen by ``--sessions default``) and how it was made are
described in ``speculant/data/NOTICE.md``; ``tools/make_sessions.py`` writes it.

:func:`load_sessions` checks every line and field and stops at the first problem with an error
naming the file, the line and the field, and what to write instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["Answer", "DEFAULT_FILE", "KINDS", "Session", "TOOL_RESULT", "load_sessions", "select_sessions",
           "sessions_path", "turn_messages"]

KINDS = ("chat", "coding", "agent", "mt_bench")
FIELDS = ("id", "kind", "system", "tools", "turns", "source", "licence")
DEFAULT_FILE = "sessions.jsonl"  # in the package's data directory
TOOL_RESULT = "(The benchmark does not run tools: the next user message says what this call returned.)"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class Session:
    """One session of a sessions file (see the module docstring); ``tools`` as in the file."""

    id: str
    kind: str
    system: str | None
    tools: tuple[dict, ...] | None = field(hash=False)
    turns: tuple[str, ...]
    source: str
    licence: str


@dataclass(frozen=True)
class Answer:
    """What the server answered to one turn: ``text`` (the streamed ``content``, joined) and
    ``tool_calls`` in OpenAI's form (``{"id", "type": "function", "function": {"name", "arguments"}}``,
    ``arguments`` a JSON string)."""

    text: str
    tool_calls: tuple[dict, ...] = field(default=(), hash=False)

    def messages(self) -> list[dict]:
        """The answer as the history's messages: the assistant's, then a ``tool`` message per call."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["content"] = self.text or None  # as OpenAI's clients send an answer that only called tools
            msg["tool_calls"] = [dict(c) for c in self.tool_calls]
        return [msg, *({"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in self.tool_calls)]


def turn_messages(session: Session, answers: list[Answer] | tuple[Answer, ...]) -> list[dict]:
    """The ``messages`` of turn ``len(answers)`` (0-based) of ``session``, given the server's
    answers to the earlier turns."""
    k = len(answers)
    if k >= len(session.turns):
        raise ValueError(f"session {session.id} has {len(session.turns)} turns; there is no turn {k + 1}")
    out: list[dict] = [{"role": "system", "content": session.system}] if session.system is not None else []
    for j, answer in enumerate(answers):
        out.append({"role": "user", "content": session.turns[j]})
        out += answer.messages()
    out.append({"role": "user", "content": session.turns[k]})
    return out


def sessions_path(spec: str) -> Path:
    """``spec`` as a file: ``default`` is the shipped file, anything else a path."""
    if spec == "default":
        return Path(str(resources.files("speculant").joinpath("data", DEFAULT_FILE)))
    return Path(spec)


def load_sessions(spec: str | Path = "default") -> list[Session]:
    """Every session of the file ``spec`` (``default``: the shipped one), checked."""
    path = sessions_path(str(spec))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--sessions {spec}: no such file (give a JSONL file of sessions, or 'default' for "
                          "the shipped one)") from None
    except IsADirectoryError:
        raise ConfigError(f"--sessions {spec} is a directory: give a JSONL file of sessions") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a sessions file is JSON Lines in UTF-8") from None
    sessions, seen = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno}); each line is one session "
                              "object") from None
        s = _session(obj, where)
        if s.id in seen:
            raise ConfigError(f"{where}: field 'id': {s.id!r} is the id of line {seen[s.id]} too; ids must be unique")
        seen[s.id] = n
        sessions.append(s)
    if not sessions:
        raise ConfigError(f"{path}: no sessions in the file (one JSON object per line)")
    return sessions


def select_sessions(sessions: list[Session], kinds: tuple[str, ...] | None = None,
                    limit: int | None = None) -> list[Session]:
    """The sessions of the given ``kinds`` (None: all), the first ``limit`` of them (None: all)."""
    if kinds is not None:
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ConfigError(f"--sessions-kinds: unknown kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
        sessions = [s for s in sessions if s.kind in kinds]
        if not sessions:
            raise ConfigError(f"--sessions-kinds {','.join(kinds)}: the file has no session of that kind")
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        sessions = sessions[:limit]
    return sessions


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _session(obj: Any, where: str) -> Session:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a session is a JSON object, got {_kind(obj)}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise ConfigError(f"{where}: field {missing[0]!r} is missing; a session has {', '.join(FIELDS)}")
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise ConfigError(f"{where}: field {extra[0]!r} is not a session field; use only {', '.join(FIELDS)}")

    def text(name: str, value: Any, nullable: bool = False) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or not value.strip():
            what = "a non-empty string" + (" or null" if nullable else "")
            raise ConfigError(f"{where}: field {name!r} must be {what}, got "
                              f"{'an empty string' if isinstance(value, str) else _kind(value)}")
        return value

    sid = text("id", obj["id"])
    kind = obj["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{where}: field 'kind' is {json.dumps(kind)}; use one of {', '.join(KINDS)}")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: field 'turns' must be a non-empty list of the user's messages, got "
                          f"{'an empty list' if turns == [] else _kind(turns)}")
    for i, t in enumerate(turns):
        text(f"turns[{i}]", t)
    return Session(sid, kind, text("system", obj["system"], nullable=True), _tools(obj["tools"], where),
                   tuple(turns), text("source", obj["source"]), text("licence", obj["licence"]))


def _tools(tools: Any, where: str) -> tuple[dict, ...] | None:
    """``tools`` checked: null, or a non-empty list of OpenAI function tools with distinct names."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise ConfigError(f"{where}: field 'tools' must be null or a non-empty list of "
                          f"{{\"type\": \"function\", \"function\": {{...}}}} tools, got "
                          f"{'an empty list' if tools == [] else _kind(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        at = f"{where}: field 'tools[{i}]'"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise ConfigError(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              f"\"description\": ..., \"parameters\": {{...}}}}}}")
        fn = tool["function"]
        if not isinstance(fn, dict):
            raise ConfigError(f"{at}.function must be an object, got {_kind(fn)}")
        extra = sorted(set(fn) - _FUNCTION_KEYS)
        if extra:
            raise ConfigError(f"{at}.function has {extra[0]!r}; a function takes {', '.join(sorted(_FUNCTION_KEYS))}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"{at}.function.name must be 1-64 letters, digits, '_' or '-', got "
                              f"{json.dumps(name) if isinstance(name, str) else _kind(name)}")
        if name in names:
            raise ConfigError(f"{at}.function.name {name!r} is used by an earlier tool; names must be distinct")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ConfigError(f"{at}.function.description must be a string, got {_kind(fn['description'])}")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type") != "object"):
            raise ConfigError(f"{at}.function.parameters must be a JSON schema object with \"type\": \"object\"")
    return tuple(tools)
