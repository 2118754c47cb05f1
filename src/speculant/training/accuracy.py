"""Per-head top-i accuracies on calibration sequences, and the data-driven sparse tree built from them.

``acc[k][i]`` = P(head k's i-th ranked token is the true token), with the loss's alignment: the
target's final hidden state at position t, through head k (0-based), is scored against token
``t + k + 2`` (``speculant.heads``), over the positions whose true token counts (the answer tokens
when ``prompt_lens`` is given). Ranks are ``topk`` order, as
``drafters.head_steps.IndependentHeads.candidates`` uses.
These accuracies feed :func:`speculant.trees.search.greedy_tree` (the Medusa construction).

Sequential heads (``heads.SequentialHeads``) are scored teacher-forced: depth k+1 reads the true tokens
t+1 .. t+k+1, so ``acc[k][i]`` is the accuracy of rank i *given a correct parent* — exactly the
factor a tree node's probability needs.

Use calibration sequences the heads were not trained on (e.g. the training run's held-out part, or
a fresh ``distill`` of other prompts) and never Spec-Bench prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError
from ..store.models import LoadedModel
from ..heads import MedusaHeads, SequentialHeads
from .losses import row_inputs
from ..trees.search import expected_length, greedy_tree

__all__ = ["build_tree", "head_topk_accuracy"]


@torch.no_grad()
def head_topk_accuracy(target, heads: MedusaHeads | SequentialHeads, sequences: Sequence[Sequence[int]],
                       max_rank: int, *,
                       prompt_lens: Sequence[int] | None = None, chunk: int = 64,
                       return_counts: bool = False):
    """-> ``acc`` as a K x ``max_rank`` list of floats (and the (K,) counts with ``return_counts``).

    target: a ``LoadedModel`` or transformers causal LM; heads: ``MedusaHeads`` for it.
    sequences: token-id lists (prompt + answer); ``prompt_lens[s]``: tokens of sequence s before
    the answer (targets before it are not counted). ``chunk``: positions scored at once (memory:
    K · chunk · V logits).
    """
    model = target.model if isinstance(target, LoadedModel) else target
    K, V = heads.num_heads, heads.config.vocab_size
    if not isinstance(max_rank, int) or not 1 <= max_rank <= V:
        raise ConfigError(f"max_rank must be an integer in [1, {V}], got {max_rank!r}")
    if prompt_lens is not None and len(prompt_lens) != len(sequences):
        raise ConfigError(f"prompt_lens has {len(prompt_lens)} entries for {len(sequences)} sequences")
    device = next(model.parameters()).device
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    decoder = model.get_decoder()
    for s, seq in enumerate(sequences):
        ids = torch.as_tensor(list(seq), dtype=torch.long, device=device)  # (T,)
        T = ids.shape[0]
        if T < 3:
            continue
        start = int(prompt_lens[s]) if prompt_lens is not None else 0
        hidden = decoder(input_ids=ids[None]).last_hidden_state[0]  # (T, H)
        if isinstance(heads, SequentialHeads) and heads.context is not None:  # the context layer's output
            hidden = heads.context(hidden[None].to(heads.dtype))[0]
        inputs = row_inputs(ids.cpu(), K).to(device) if isinstance(heads, SequentialHeads) else None  # (T, K)
        for a in range(0, T - 2, chunk):
            b = min(a + chunk, T - 2)  # positions t in [a, b): head 0 needs t + 2 < T
            tokens = inputs[a:b] if inputs is not None else None
            logits = heads(hidden[a:b], tokens)[..., :V]
            if tokens is not None:  # sequential heads rank only their draft vocabulary, as drafting does
                logits = heads.mask_to_draft_vocab(logits)
            top = logits.topk(max_rank, dim=-1, sorted=True).indices  # (K, C, R)
            t = torch.arange(a, b, device=device)
            for k in range(K):
                j = t + k + 2  # (C,) positions of the true tokens
                ok = (j < T) & (j >= start)
                if not bool(ok.any()):
                    continue
                truth = ids[j[ok]]  # (n,)
                hits[k] += (top[k][ok] == truth[:, None]).double().sum(0).cpu()
                counts[k] += int(ok.sum())
    if not bool((counts > 0).all()):
        empty = [k for k in range(K) if counts[k] == 0]
        raise ConfigError(f"the calibration sequences leave heads {empty} without any position to score: "
                          f"give longer or more sequences (head k needs answers of more than k + 2 tokens)")
    acc = (hits / counts[:, None]).tolist()
    return (acc, counts.long().tolist()) if return_counts else acc


def build_tree(target, heads: MedusaHeads | SequentialHeads, sequences: Sequence[Sequence[int]], budget: int, *,
               max_rank: int = 10, prompt_lens: Sequence[int] | None = None,
               out_path: str | os.PathLike | None = None) -> dict:
    """Measure ``acc`` (K x ``max_rank``), grow the greedy tree of ``budget`` nodes and (with
    ``out_path``) write its paths as a JSON list, the format ``--tree-file`` reads.

    Returns ``{"paths", "accuracies", "positions", "expected_accepted_per_step"}``, the last being
    Σ over nodes of Π acc along the path (τ ≈ 1 + it, tokens per target call).
    """
    max_rank = min(max_rank, heads.config.vocab_size)
    acc, counts = head_topk_accuracy(target, heads, sequences, max_rank, prompt_lens=prompt_lens,
                                     return_counts=True)
    paths = greedy_tree(acc, budget)
    result = {"paths": paths, "accuracies": acc, "positions": counts,
              "expected_accepted_per_step": expected_length(paths, acc) if paths else 0.0}
    if out_path is not None:
        p = Path(out_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(paths) + "\n")
    return result
