"""Thinking models (Qwen3 and its kin): the switch in their chat template, and the thinking they
write before the answer, returned apart from it.

Request side (``template_variables``, checked with the body): ``chat_template_kwargs`` (vLLM's
and llama-server's extension) is an object of extra variables for the chat template, e.g.
``{"enable_thinking": false}``; a key the server or the tokenizer sets itself (``messages``,
``tools``, ``add_generation_prompt``, apply_chat_template's own parameters, the special tokens,
the template's functions) is refused, a null value is as if the key were absent, and
``enable_thinking`` must be true or false. ``reasoning_effort`` (OpenAI's) maps onto the same
switch: "none" and "minimal" turn thinking off, "low", "medium" and "high" on (the template has no
finer budget); with an ``enable_thinking`` that says otherwise it is refused. An assistant
message given back may carry the ``reasoning_content`` its reply had (``given_thinking``), for the
templates that render an earlier turn's thinking.

Model side (``Thinking``): the template's text says whether it has the switch (it reads
``enable_thinking``) and whether the model thinks in ``<think>...</think>`` (it mentions
``<think>``). ``Thinking.check`` refuses, for a given model, ``reasoning_effort`` without the switch
and a variable the template never reads (a misspelt key must not be silently ignored).

Response side (``ReasoningStream``): for a thinking template, a completion that begins (after
whitespace) with ``<think>``, or whose prompt already ends with one (templates that open the
thinking in the generation prompt), has its thinking up to ``</think>`` sent as
``reasoning_content`` and the rest as ``content``. The whitespace around the thinking and right
after ``</think>`` is dropped; a thinking never closed is all reasoning. Text is sent as it comes;
only what may be the beginning of a tag (and whitespace that may turn out to end the thinking) is
held back. A completion without the tag is all content, unchanged. Splitting text changes nothing
that is generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import bad_request, kind_of, show

THINK = ("<think>", "</think>")
SWITCH = "enable_thinking"
# reasoning_effort: whether the model thinks (the template's switch is all there is to set)
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}
# what the server, the tokenizer or transformers give the template: apply_chat_template's
# parameters, the template's variables and functions, the tokenizer's special tokens
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "raise_exception", "strftime_now", "namespace", "dict",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens"})


def template_variables(body: dict) -> tuple[dict[str, Any], str | None]:
    """A chat request's extra chat-template variables (``chat_template_kwargs``, with
    ``reasoning_effort`` as ``enable_thinking``) and its reasoning_effort (None: absent); a 400
    naming the field at fault."""
    given, effort = body.get("chat_template_kwargs"), body.get("reasoning_effort")
    variables: dict[str, Any] = {}
    if given is not None:
        if not isinstance(given, dict):
            raise bad_request("'chat_template_kwargs' must be an object of variables for the chat template, e.g. "
                              f"{{\"enable_thinking\": false}}, got {kind_of(given)}", param="chat_template_kwargs")
        for key, value in given.items():
            where = f"chat_template_kwargs.{key}"
            if key in RESERVED:
                raise bad_request(f"{show(where)} is set by the server, not by the request (the chat template gets "
                                  "it from the request's messages and tools or from the tokenizer); remove it",
                                  param=where)
            if value is None:
                continue
            if key == SWITCH and not isinstance(value, bool):
                raise bad_request(f"{show(where)} must be true or false, got {show(value)}", param=where)
            variables[key] = value
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(map(repr, EFFORTS))}, got "
                              f"{show(effort)}", param="reasoning_effort")
        thinks = EFFORTS[effort]
        if variables.get(SWITCH, thinks) != thinks:
            raise bad_request(f"'reasoning_effort' {effort!r} turns thinking {'on' if thinks else 'off'} but "
                              f"'chat_template_kwargs.{SWITCH}' is {str(not thinks).lower()}: send one of them",
                              param="reasoning_effort")
        variables[SWITCH] = thinks
    return variables, effort


def given_thinking(message: dict, where: str) -> str | None:
    """An assistant message's ``reasoning_content`` (its reply's thinking, given back with it):
    its text, None when absent, null or empty; a 400 naming the field if it is not a string."""
    value = message.get("reasoning_content")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise bad_request(f"{where}.reasoning_content must be a string (the turn's thinking), got {kind_of(value)}",
                          param=f"{where}.reasoning_content")
    return value


@dataclass(frozen=True)
class Thinking:
    """What a chat template says about thinking: ``switch``, it reads ``enable_thinking``;
    ``tags``, the model thinks in ``<think>...</think>``; ``text``, the template's text (every
    named template's, for a tokenizer with several)."""
    switch: bool
    tags: bool
    text: str

    @classmethod
    def of(cls, tokenizer: Any) -> "Thinking":
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = "\n".join(t for t in template.values() if isinstance(t, str))
        text = template if isinstance(template, str) else ""
        return cls(reads(text, SWITCH), THINK[0] in text, text)

    def check(self, variables: dict[str, Any], effort: str | None) -> None:
        """A 400 for ``reasoning_effort`` when the template has no switch, and for a variable it
        never reads (``variables``: ``template_variables``' own)."""
        if effort is not None and not self.switch:
            raise bad_request(f"'reasoning_effort': this model has no reasoning control (its chat template has no "
                              f"'{SWITCH}' switch); remove the field", param="reasoning_effort",
                              code="unsupported_parameter")
        for key in variables:
            if not reads(self.text, key):
                raise bad_request(f"{show('chat_template_kwargs.' + key)}: the model's chat template does not use "
                                  f"this variable, so it would change nothing; remove it",
                                  param=f"chat_template_kwargs.{key}", code="unsupported_parameter")

    def opened(self, prompt: str) -> bool:
        """Whether the completion of ``prompt`` (the rendered chat) starts inside the thinking:
        the template opened it in the generation prompt."""
        return self.tags and prompt.rstrip().endswith(THINK[0])


def reads(template: str, name: str) -> bool:
    """Whether a template's text names the variable ``name`` (not as an attribute, ``x.name``)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", template) is not None


def _partial_end(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """The splitter of one completion (module doc): ``feed(text)`` and then ``finish()`` return
    deltas, ``{"reasoning_content": ...}`` and ``{"content": ...}``. ``opened``: the prompt ended
    with ``<think>``, so the completion starts inside the thinking."""

    def __init__(self, opened: bool = False):
        self._state = "thinking" if opened else "start"  # start | thinking | after | answer
        self._text = ""  # held back: a possible tag's beginning, whitespace
        self._lead = True  # thinking: its leading whitespace still to drop

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._text += text
        while True:
            if self._state == "start":
                s = self._text.lstrip()
                if s.startswith(THINK[0]):
                    self._state, self._text = "thinking", s[len(THINK[0]):]
                    continue
                if THINK[0].startswith(s):  # nothing but whitespace, or the tag's beginning: undecided
                    return out
                self._state = "answer"
            elif self._state == "thinking":
                if self._lead:
                    self._text = self._text.lstrip()
                    if not self._text:
                        return out
                    self._lead = False
                at = self._text.find(THINK[1])
                if at >= 0:
                    _send(out, "reasoning_content", self._text[:at].rstrip())
                    self._state, self._text = "after", self._text[at + len(THINK[1]):]
                    continue
                ready = self._text[:len(self._text) - _partial_end(self._text, THINK[1])].rstrip()
                _send(out, "reasoning_content", ready)
                self._text = self._text[len(ready):]
                return out
            elif self._state == "after":
                self._text = self._text.lstrip()
                if not self._text:
                    return out
                self._state = "answer"
            else:
                _send(out, "content", self._text)
                self._text = ""
                return out

    def finish(self) -> list[dict]:
        """The deltas of what is still held: undecided text as content, an unclosed thinking's end
        as reasoning (its trailing whitespace dropped)."""
        out: list[dict] = []
        held, self._text = self._text, ""
        if self._state == "start":
            _send(out, "content", held)
        elif self._state == "thinking":
            _send(out, "reasoning_content", held.rstrip())
        return out


def _send(out: list[dict], key: str, text: str) -> None:
    if text:
        out.append({key: text})


def split(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole completion: the same machine fed the whole text."""
    stream = ReasoningStream(opened)
    deltas = stream.feed(text) + stream.finish()
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") for d in deltas))
