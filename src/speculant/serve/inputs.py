"""The prompt-like fields of a request, checked: ``/v1/completions``' ``prompt`` in every form
OpenAI takes, its ``suffix`` (fill-in-the-middle) and the ``prediction`` of both endpoints.

``prompt``: a string, a list of strings (a batch: one choice per prompt, in order), a list of
token ids, or a list of lists of token ids (what evaluation harnesses such as lm-evaluation-harness'
``local-completions`` send). Token ids are checked against the model's vocabulary by the app,
which knows it. ``suffix``: the text after the gap the completion fills (the model's own
fill-in-the-middle tokens build the prompt: ``fim``); empty means none. ``prediction``: OpenAI's
Predicted Outputs, ``{"type": "content", "content": str | [{"type": "text", "text": str}, ...]}``:
text the output is expected to be, which prompt lookup drafts from (the output is unchanged).
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request, is_int as _is_int, kind_of as _kind, show as _show

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; the app checks against the model's

Prompt = str | tuple[int, ...]  # text, or token ids


def completion_prompts(prompt: Any) -> tuple[Prompt, ...]:
    """``prompt`` as one or more prompts, each a non-empty string or a non-empty tuple of token
    ids; a 400 naming ``prompt`` (or ``prompt[i]``) otherwise."""
    if isinstance(prompt, str):
        return (_text(prompt, "prompt"),)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                          f"of token ids, got {_kind(prompt)}", param="prompt")
    if all(_is_int(t) for t in prompt):
        return (_ids(prompt, "prompt"),)
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed in one request",
                          param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return tuple(_text(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    if all(isinstance(p, list) for p in prompt):
        return tuple(_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    if any(_is_int(t) for t in prompt):
        j = next(i for i, t in enumerate(prompt) if not _is_int(t))
        raise bad_request(f"'prompt' mixes token ids with other values: prompt[{j}] is {_kind(prompt[j])}; a list of "
                          "token ids holds integers only", param=f"prompt[{j}]")
    j = next((i for i, p in enumerate(prompt) if not isinstance(p, (str, list))), None)
    if j is not None:
        raise bad_request(f"'prompt[{j}]' must be a string or a list of token ids, got {_kind(prompt[j])}",
                          param=f"prompt[{j}]")
    j = next(i for i, p in enumerate(prompt) if type(p) is not type(prompt[0]))
    raise bad_request(f"'prompt' mixes strings and lists of token ids (prompt[0] is {_kind(prompt[0])}, prompt[{j}] "
                      f"{_kind(prompt[j])}): send one kind", param=f"prompt[{j}]")


def _text(text: str, param: str) -> str:
    if not text.strip():
        raise bad_request(f"'{param}' is empty: give some text to continue", param=param)
    return text


def _ids(ids: list, param: str) -> tuple[int, ...]:
    if not ids:
        raise bad_request(f"'{param}' is an empty list of token ids: give at least one", param=param)
    for j, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise bad_request(f"'{param}[{j}]' must be a token id (an integer from 0), got {_show(t)}",
                              param=param)
    return tuple(ids)


def check_vocabulary(prompts: tuple[Prompt, ...], vocab_size: int) -> None:
    """A 400 naming ``prompt`` if a token-id prompt has an id outside the vocabulary."""
    for i, p in enumerate(prompts):
        if isinstance(p, tuple):
            bad = next((t for t in p if t >= vocab_size), None)
            if bad is not None:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise bad_request(f"'{where}' has the token id {bad}, outside the model's vocabulary (ids 0 to "
                                  f"{vocab_size - 1})", param=where)


def suffix_of(body: dict, prompts: tuple[Prompt, ...], echo: bool) -> str | None:
    """``suffix`` (completions): the text after the gap to fill, or None (absent, null or "")."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise bad_request(f"'suffix' must be a string (the text after the completion), got {_kind(suffix)}",
                          param="suffix")
    if any(isinstance(p, tuple) for p in prompts):
        raise bad_request("'suffix' needs a text prompt: the fill-in-the-middle prompt is built from the prompt's "
                          "text and the suffix's", param="suffix")
    if echo:
        raise bad_request("'suffix' cannot be combined with \"echo\": true; send one of them", param="suffix")
    return suffix


def prediction_of(value: Any) -> str | None:
    """``prediction`` (OpenAI's Predicted Outputs) as its text; None when absent or empty."""
    if value is None:
        return None
    shape = ("{\"type\": \"content\", \"content\": a string or a list of {\"type\": \"text\", \"text\": ...} "
             "parts}")
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise bad_request(f"'prediction' must be {shape}, got {_show(value)}", param="prediction")
    content = value.get("content")
    if isinstance(content, str):
        return content or None
    if not isinstance(content, list):
        raise bad_request(f"'prediction.content' must be a string or a list of text parts, got {_kind(content)}",
                          param="prediction.content")
    texts = []
    for i, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                and not set(part) - {"type", "text"}):
            raise bad_request(f"'prediction.content[{i}]' must be {{\"type\": \"text\", \"text\": ...}}, got "
                              f"{_show(part)}", param=f"prediction.content[{i}]")
        texts.append(part["text"])
    return "".join(texts) or None
