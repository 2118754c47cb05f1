"""llama-server's ``POST /tokenize`` and ``POST /detokenize``, which agents and editors call to
measure a prompt before sending it.

``/tokenize``: ``{"content": string, "add_special"?: bool (default false), "with_pieces"?: bool}``
gives ``{"tokens": [ids]}``, or with ``with_pieces`` ``{"tokens": [{"id", "piece"}]}`` (a piece
that is not whole UTF-8 text by itself comes as its bytes, a list of integers, as llama-server
sends it). ``/detokenize``: ``{"tokens": [ids]}`` gives ``{"content": string}``; an id outside the
vocabulary is a 400.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request

from .errors import bad_request, is_int, kind_of

MAX_DETOKENIZE = 1 << 20  # token ids a /detokenize body may hold


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {kind_of(value)}", param=name)
    return value


def _body(body: Any, fields: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind_of(body)}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}: use {', '.join(sorted(fields))}", param=unknown[0])
    return body


def tokens_of(tokenizer: Any, body: Any) -> dict:
    """The answer of /tokenize to ``body`` (module doc)."""
    body = _body(body, {"content", "add_special", "with_pieces", "parse_special"})
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request(f"'content' must be the text to tokenize, a string; got {kind_of(content)}",
                          param="content")
    ids = tokenizer(content, add_special_tokens=_flag(body, "add_special")).input_ids
    if not _flag(body, "with_pieces"):
        return {"tokens": ids}
    pieces = []
    for i in ids:
        text = tokenizer.decode([i])
        whole = "\ufffd" not in text
        pieces.append({"id": i, "piece": text if whole else list(tokenizer.convert_ids_to_tokens(i).encode())})
    return {"tokens": pieces}


def text_of(tokenizer: Any, vocab_size: int, body: Any) -> dict:
    """The answer of /detokenize to ``body`` (module doc)."""
    body = _body(body, {"tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE or not all(is_int(t) for t in ids):
        raise bad_request("'tokens' must be a list of token ids (integers)", param="tokens")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise bad_request(f"'tokens' has {outside[0]}, outside the model's vocabulary (ids 0 to {vocab_size - 1})",
                          param="tokens")
    return {"content": tokenizer.decode(ids)}


def add_tokenizer_routes(app: FastAPI, tokenizer: Any, vocab_size: int, authorize: Callable,
                         read_json: Callable) -> None:
    """/tokenize and /detokenize on ``app`` (errors in OpenAI's shape, as the app's others)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        return tokens_of(tokenizer, await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        return text_of(tokenizer, vocab_size, await read_json(request))
