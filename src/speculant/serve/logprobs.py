"""OpenAI's ``logprobs`` objects of one response, built token by token from its ``Token`` events.

Chat (``choices[0].logprobs``)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}

Completions::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}

There is one entry per completion token (``usage.completion_tokens`` of them), the top ones most
likely first. A streamed chunk carries the entries of the tokens whose events it is sent for (one
chunk per token when logprobs are asked for, with the text that token's event brought, possibly "").

With ``echo``, the prompt's tokens come first (:meth:`Logprobs.add_prompt`), the first one's
log-probability null. Log-probabilities are the target model's own (the log-softmax of its raw logits, before
temperature, penalties, logit bias and filtering: ``decoding.TokenLogprob``), the same under every
method. One that is -inf is reported as -9999.0, as OpenAI does for "very unlikely" (JSON has no
infinity).

Token strings are the tokenizer's decode of that one id (special tokens such as the end of
sequence included) and ``bytes`` their UTF-8 encoding. That is an approximation where a token is
part of a multi-byte character (it decodes to U+FFFD, whose bytes EF BF BD are not the token's
own) and for tokenizers that decode a token alone differently from the same token in context (a
word-level or SentencePiece tokenizer's spaces): the tokens need not add up to the text. In a
completions object's ``top_logprobs`` two ids with the same string keep the more likely one.
``text_offset[j]`` is where the text that came with token j's event begins in the completion's
text, so text[text_offset[j]:text_offset[j + 1]] is what token j brought: its own text, unless that
was held back (a possible start of a stop string, a partial character) and came with a later token.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Sequence

from .scheduler import Token

UNLIKELY = -9999.0  # OpenAI's log-probability of a token the model rules out
_CACHED_STRINGS = 1 << 16


def token_strings(tokenizer) -> Callable[[int], str]:
    """A token id's string (the decode of that id alone), cached."""
    @lru_cache(maxsize=_CACHED_STRINGS)
    def string(token_id: int) -> str:
        return tokenizer.decode([token_id])
    return string


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY


class Logprobs:
    """The logprobs object of one response of ``kind`` ("chat" | "completion"); ``string``: a
    token id's string (``token_strings``)."""

    def __init__(self, kind: str, string: Callable[[int], str]):
        self.kind, self.string = kind, string
        self.offset = 0  # characters of text the events so far have brought
        self.all = self._empty()  # every token's entries: the response's object

    def _empty(self) -> dict[str, list]:
        if self.kind == "chat":
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.string(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def add_prompt(self, ids: Sequence[int], scored: Sequence, text: str) -> dict[str, list]:
        """Record the entries of an echoed prompt (completions): token ids ``ids``, each one's
        ``decoding.TokenLogprob`` in ``scored`` (None for the first: null, as OpenAI has it), the
        prompt's ``text``; returns their object. A prompt token's ``text_offset`` adds up the token
        strings before it (where they do not add up to the text, e.g. a BOS token, it is approximate);
        the completion's tokens then count from the end of ``text``."""
        one = self._empty()
        at = 0
        for token_id, lp in zip(ids, scored):
            one["tokens"].append(self.string(token_id))
            one["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
            top: dict[str, float] | None = None
            if lp is not None:
                top = {}
                for i, v in lp.top:
                    top.setdefault(self.string(i), _finite(v))
            one["top_logprobs"].append(top)
            one["text_offset"].append(min(at, len(text)))
            at += len(self.string(token_id))
        self.offset = len(text)
        for key, entries in one.items():
            self.all[key].extend(entries)
        return one

    def add(self, event: Token) -> dict[str, list]:
        """Record the entry of the token of ``event`` and return the object of that token alone
        (the logprobs of the chunk sent for it)."""
        one = self._empty()
        lp = event.logprob
        if lp is not None:
            if self.kind == "chat":
                one["content"].append({**self._chat_token(event.token_id, lp.logprob),
                                       "top_logprobs": [self._chat_token(i, v) for i, v in lp.top]})
            else:
                top: dict[str, float] = {}
                for i, v in lp.top:
                    top.setdefault(self.string(i), _finite(v))
                one["tokens"].append(self.string(event.token_id))
                one["token_logprobs"].append(_finite(lp.logprob))
                one["top_logprobs"].append(top)
                one["text_offset"].append(self.offset)
        self.offset += len(event.text)
        for key, entries in one.items():
            self.all[key].extend(entries)
        return one
