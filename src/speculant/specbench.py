"""Spec-Bench's questions (``data/spec_bench_questions.jsonl``, or a file of the same form): what
``speculant bench`` runs, and what the training corpora are kept apart from."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .errors import ConfigError

__all__ = ["load_questions"]


def load_questions(path: str | None = None) -> list[dict]:
    """Spec-Bench questions; MT-bench's eight categories (ids 81-160) are grouped as mt_bench. A
    ``path`` that cannot be read, or a line that is no such question, is a ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8") if path else \
            resources.files("speculant").joinpath("data/spec_bench_questions.jsonl").read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "it is not UTF-8 text"
        raise ConfigError(f"cannot read --questions {path}: {why}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            r = json.loads(line) if line.strip() else None
        except ValueError:
            r = False
        if r is not None and not (isinstance(r, dict) and isinstance(r.get("question_id"), int)
                                  and isinstance(r.get("category"), str) and r.get("turns")
                                  and isinstance(r["turns"], list) and isinstance(r["turns"][0], str)):
            raise ConfigError(f'--questions {path} line {n} is not a question: write one JSON object per line, '
                              '{"question_id": 1, "category": "qa", "turns": ["the prompt"]}')
        if r is not None:
            r["group"] = "mt_bench" if 81 <= r["question_id"] <= 160 else r["category"]
            rows.append(r)
    return rows
