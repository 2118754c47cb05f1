"""A corpus's answers without its prompts: what can be committed when the prompts are not ours to
redistribute (``make-corpus --families human``: people's ShareGPT turns).

The packed file is gzip-compressed JSON Lines, one record per answered prompt, in corpus order::

    {"sha256": hex digest of the prompt's UTF-8 text, "prompt_len": int, "answer": [token ids], "finish_reason": str}

:func:`unpack` makes the corpus records again from the prompts (read from their package) and the
tokenizer: a prompt's ids are the chat template's encoding of its text, checked against
``prompt_len``, followed by the answer. The packed file is written atomically, so a job killed
while writing leaves the previous one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import ConfigError

__all__ = ["pack", "prompt_digest", "read_packed", "unpack"]


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def pack(records: Iterable[dict], path: str | os.PathLike) -> int:
    """Write ``records`` (corpus records: ``prompt``, ``prompt_len``, ``ids``, ``finish_reason``)
    to the packed file ``path`` without their prompts; the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for r in records:
                line = {"sha256": prompt_digest(r["prompt"]), "prompt_len": r["prompt_len"],
                        "answer": r["ids"][r["prompt_len"]:], "finish_reason": r.get("finish_reason")}
                f.write((json.dumps(line, separators=(",", ":")) + "\n").encode())
                n += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def read_packed(path: str | os.PathLike) -> list[dict]:
    """The records of packed file ``path``, or a clear error if it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            out = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not a packed corpus (gzip JSON Lines): {type(e).__name__}: {e}") from None
    for i, r in enumerate(out):
        if not (isinstance(r, dict) and isinstance(r.get("sha256"), str) and isinstance(r.get("prompt_len"), int)
                and isinstance(r.get("answer"), list)):
            raise ConfigError(f"{path}: record {i + 1} lacks sha256, prompt_len or answer: not a packed corpus")
    return out


def unpack(packed: Sequence[dict], prompts: Sequence[str], encode: Callable[[str], list[int]]) -> list[dict]:
    """Corpus records of the ``packed`` answers (:func:`read_packed`) whose prompt is in ``prompts``,
    in packed order: ``encode(prompt)`` (its chat-template ids) then the answer. A packed answer
    whose prompt is not among ``prompts`` is skipped (another filter or seed made it); an encoding
    of another length than the one recorded is an error (another tokenizer or template)."""
    by_digest = {prompt_digest(p): p for p in prompts}
    out = []
    for r in packed:
        prompt = by_digest.get(r["sha256"])
        if prompt is None:
            continue
        ids = list(encode(prompt))
        if len(ids) != r["prompt_len"]:
            raise ConfigError(f"a packed answer's prompt encodes to {len(ids)} tokens, not the {r['prompt_len']} it "
                              "was answered from: the packed corpus was made with another tokenizer or chat "
                              "template; make it again without --packed")
        out.append({"prompt": prompt, "prompt_len": len(ids), "ids": ids + list(r["answer"]),
                    "finish_reason": r.get("finish_reason")})
    return out
