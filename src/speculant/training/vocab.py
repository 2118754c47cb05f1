"""Draft vocabularies (FR-Spec): the token ids a drafter that projects through the target's frozen
output layer may propose — sequential heads and the EAGLE drafter. Ranking a draft vocabulary of
V' ids reads V' rows of the output layer per drafted depth, so a shorter list drafts faster, and
loses only the proposals of the tokens left out (the target verifies every token either way).

Both kinds of drafter store the list as the tensor ``draft_vocab`` (V',) int64 in their weights
and its length in their config (``speculant_draft_vocab``; ``speculant_eagle.draft_vocab``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..errors import ConfigError, ModelLoadError
from .conversations import answer_spans

__all__ = ["cut_draft_vocab", "draft_vocabulary"]

KEPT_FILES = ("tree.json", "calibration.json", "training_report.json")  # copied beside a cut drafter


def draft_vocabulary(records: Sequence[dict], n: int, vocab_size: int,
                     within: Iterable[int] | None = None) -> torch.Tensor:
    """The ``n`` token ids a drafter may propose: the answer tokens of ``records`` by decreasing
    frequency, then the lowest ids not taken yet (byte-level BPE vocabularies number tokens in
    merge order, so low ids are the frequent ones); only ids of ``within`` when given. Sorted (n,) long."""
    allowed = None if within is None else {int(t) for t in within}
    pool = range(vocab_size) if allowed is None else sorted(t for t in allowed if 0 <= t < vocab_size)
    if n > len(pool):
        raise ConfigError(f"a draft vocabulary of {n} tokens cannot be drawn from {len(pool)}")
    counts = Counter(t for r in records for a, b in answer_spans(r) for t in r["ids"][a:b]
                     if 0 <= t < vocab_size and (allowed is None or t in allowed))
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
    taken = set(chosen)
    fill = (i for i in pool if i not in taken)
    chosen += [next(fill) for _ in range(n - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def _size_field(config: dict) -> tuple[dict, str]:
    """The dict holding a drafter config's fields (``vocab_size`` among them) and the key of its
    draft-vocabulary length there."""
    if isinstance(config.get("speculant_eagle"), dict):
        return config["speculant_eagle"], "draft_vocab"
    if config.get("speculant_head_kind") == "sequential":
        return config, "speculant_draft_vocab"
    raise ModelLoadError("not a drafter with a draft vocabulary: expected an EAGLE drafter (train-eagle) or "
                         "sequential heads (train-heads --head-kind sequential)")


def cut_draft_vocab(drafter: str | Path, records: Sequence[dict], n: int, out: str | Path,
                    dtype: torch.dtype | None = None) -> Path:
    """Write to ``out`` the drafter at ``drafter`` (an EAGLE drafter or sequential heads) with its
    draft vocabulary cut to the ``n`` of its ids most frequent in ``records``' answers (its other
    files copied unchanged). The drafter's weights do not change (but for ``dtype``): they read
    states, and the vocabulary only says which rows of the target's output layer are ranked.
    ``dtype``: store the floating-point weights in it (bfloat16 halves a float32 drafter's file;
    decoding runs it in int4 or bf16 where the kernels do), default as they are."""
    from safetensors.torch import load_file

    from ..heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, floats_in, write_checkpoint

    src, dst = Path(drafter), Path(out)
    if src.resolve() == dst.resolve():
        raise ConfigError(f"--out must be a new directory, not the drafter's own ({src})")
    if not (src / CONFIG_NAME).is_file() or not (src / WEIGHTS_NAME).is_file():
        raise ModelLoadError(f"no drafter at {src}: expected a directory with {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = json.loads((src / CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{src / CONFIG_NAME} is corrupt (not valid JSON: {e})") from None
    try:
        state = load_file(str(src / WEIGHTS_NAME))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for truncated / bad headers
        raise ModelLoadError(f"{src / WEIGHTS_NAME} is corrupt ({e}); re-save the drafter") from None
    holder, key = _size_field(config)
    old = state.get("draft_vocab")
    if old is None or not holder.get(key):
        raise ConfigError(f"{src} proposes from the whole vocabulary (no draft vocabulary to cut); train it with "
                          "--draft-vocab N instead")
    if not isinstance(n, int) or not 0 < n <= old.numel():
        raise ConfigError(f"the cut draft vocabulary must have 1 to {old.numel()} tokens (the drafter's own), "
                          f"got {n!r}")
    state["draft_vocab"] = draft_vocabulary(records, n, int(holder["vocab_size"]), within=old.tolist())
    holder[key] = n
    if dtype is not None:
        state = floats_in(state, dtype)
    write_checkpoint(dst, state, config, "the drafter")
    for name in KEPT_FILES:  # unchanged: they describe the drafter's states, not its vocabulary
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst
