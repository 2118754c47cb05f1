"""Warm a decoder's recycled-draft table (``drafters.recycling``) by prefill over real
conversations (``training.conversations``: chitchat or sharegpt, never Spec-Bench: conversations
sharing a word n-gram with it are skipped): the target's top-k after every token of each
conversation, in its chat template, written to the table as a verification pass would, then the
table saved. ``speculant warm-drafts --corpus chitchat --limit N``."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["warm_table"]

CHUNK = 256  # tokens per prefill pass


def warm_table(dec, corpus: str = "chitchat", limit: int = 100, max_len: int = 1024) -> dict:
    """Prefill ``limit`` conversations of ``corpus`` through ``dec``'s target into its table (a
    decoder of method recycle); returns counts. The table is saved where the decoder keeps it."""
    from .conversations import (ConversationFilter, _alternating, _grams, _words, chitchat_conversations,
                                conversation_record, eval_ngrams, sharegpt_conversations)

    table = dec._parts.table
    if table is None:
        raise ConfigError("warm-drafts fills the table of --method recycle: build the decoder with method='recycle'")
    readers = {"chitchat": chitchat_conversations, "sharegpt": sharegpt_conversations}
    if corpus not in readers:
        raise ConfigError(f"unknown corpus {corpus!r}: use {', '.join(readers)}")
    if limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    n_gram = ConversationFilter().overlap_n
    banned = eval_ngrams(n_gram)
    backend, V = dec.target_backend, dec.vocab_size
    counts: dict[str, Any] = {"read": 0, "spec_bench_overlap": 0, "used": 0, "tokens": 0}
    with torch.inference_mode():
        for _, raw in readers[corpus]():
            if counts["used"] >= limit:
                break
            counts["read"] += 1
            turns = _alternating(raw)
            if not turns:
                continue
            if any(g in banned for g in _grams(_words("\n".join(t for _, t in turns)), n_gram)):
                counts["spec_bench_overlap"] += 1
                continue
            rec = conversation_record(dec.tokenizer, turns, max_len)
            if rec is None:
                continue
            ids = torch.tensor(rec["ids"], dtype=torch.long)
            backend.reset()
            for a in range(0, ids.shape[0], CHUNK):
                rows = ids[a:a + CHUNK]
                top = backend.forward(rows).logits[:, :V].topk(table.k, dim=-1).indices  # (n, k)
                table.update(rows, top)
            counts["used"] += 1
            counts["tokens"] += int(ids.shape[0])
        backend.reset()
    counts["filled"] = table.filled
    counts["saved"] = str(table.save()) if table.path is not None else None
    return counts
