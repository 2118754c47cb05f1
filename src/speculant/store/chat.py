"""Prompts in a model's chat template: one user turn (:func:`chat_prompt`) or a conversation,
with tools (:func:`chat_messages_prompt`), each message checked before the template renders it."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError
from ..text_check import check_text

__all__ = ["CHAT_ROLES", "chat_messages_prompt", "chat_prompt"]


CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as one user turn in the tokenizer's chat template, ready for the assistant's
    reply; ``text`` unchanged if the tokenizer has no chat template (a base model)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return chat_messages_prompt(tokenizer, [{"role": "user", "content": text}])


def chat_messages_prompt(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                         variables: dict[str, Any] | None = None) -> str:
    """A conversation (``[{"role": "system" | "user" | "assistant", "content": str}, ...]``) in
    the tokenizer's chat template, ending with the prompt for the assistant's next turn. With
    ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` objects) the template renders
    them; an assistant message may then carry ``tool_calls`` (arguments as objects) and a ``tool``
    message (``tool_call_id``, ``content``) a call's result, as transformers' templates take them; an
    assistant message's ``reasoning_content`` (its thinking) goes to the template too.
    ``variables``: extra variables for the template (e.g. ``{"enable_thinking": False}``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template, so it cannot take chat messages: "
                          "send a plain text prompt instead")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    roles = CHAT_ROLES + ("tool",)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages[{i}] must be an object with \"role\" and \"content\", "
                              f"got {type(m).__name__}")
        if m.get("role") not in roles:
            raise ConfigError(f"messages[{i}] has role {m.get('role')!r}: use one of {', '.join(roles)}")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
        check_text(m["content"], f"messages[{i}] ({m['role']}) content")
    keys = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
    turns = [{k: m[k] for k in keys if k in m and (k != "name" or m["role"] == "tool")} for m in messages]
    extra = {**(variables or {}), **({"tools": list(tools)} if tools else {})}
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra)
