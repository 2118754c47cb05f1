"""Greedy-chain accuracy by depth of sequential heads (Hydra) and EAGLE drafters, on the same
held-out positions of a corpus, so the two kinds of drafter are compared on exactly the same text.

The records are those ``train-eagle`` holds out (``training.eagle_train.split_records``: ``--held-out``
records spread over the corpus), read with the target features ``train-eagle`` cached in ``DIR/features``
(``--features``); without them, the target computes the features of the measured records alone.
At each sampled answer position i the drafter starts from the target's state h_i and the token
x_{i+1} and guesses x_{i+2}, x_{i+3}, ...; depth d counts while its first d guesses are all the
target's own tokens (``training.eagle_train.depth_accuracy``'s measure; sequential heads follow the same
walk with their own states).

    speculant drafter-accuracy --data corpus.jsonl [--features RUN/features] \\
        --hydra data/drafters/qwen2.5-coder-1.5b-instruct/sequential --eagle RUN [RUN2 ...]

``--all-records`` measures every record of a text no drafter trained on: the forecast's table for
the shipped drafter comes from the target's greedy answers to the Spec-Bench questions the bench
does not use (``tools/teacher_forced_tau.py gen``), text like what users ask, where the drafters
are accepted far less often than on their corpora's held-out records:

    python tools/teacher_forced_tau.py gen dev.jsonl --questions 2,3,4,5 --max-new-tokens 128
    speculant drafter-accuracy --data dev.jsonl --all-records --hydra HEADS --eagle RUN

``--train-records`` measures training records instead (the same number, spread over the rest):
the gap to the held-out figure is what a drafter memorised.

Each drafter's ``tree`` table is what ``speculant.tuning.choice`` forecasts from: at the same
positions, the drafter grows the dynamic tree it drafts with in decoding (its method's default
shape, no lookup chain), and tree[d-1][m-1] is the mean number of its tokens the target's own
continuation accepts when the tree is cut to depth d and to its m best-scored nodes.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from ..config import DEFAULT_EAGLE_TREE, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS
from ..errors import ConfigError

__all__ = ["drafter_accuracy", "heads_accuracy"]


@torch.no_grad()
def heads_accuracy(heads, records, hidden, starts, depth: int, per_record: int, seed: int = 0) -> list[float]:
    """depth_accuracy's measure for sequential heads: s_0 = h_i, s_d = step(s_{d-1}, x_{i+d})."""
    from .eagle_train import answer_positions

    hits, total = [0] * depth, 0
    for r, (rec, sampled) in enumerate(zip(records, answer_positions(records, per_record, seed))):
        ids, s, L = rec["ids"], int(starts[r]), len(rec["ids"])
        for i in sampled:
            total += 1
            state = hidden[s + i][None].float()
            for d in range(depth):
                if i + 2 + d >= L:
                    break
                state = heads.step(state, torch.tensor([ids[i + 1 + d]]))
                if int(heads.draft_topk(state, 1, None)[0, 0]) != ids[i + 2 + d]:
                    break
                hits[d] += 1
    return [h / max(total, 1) for h in hits]


def drafter_accuracy(decoder, data: str | Path, hydra: Sequence[str] = (), eagle: Sequence[str] = (),
                     features: str | None = None, held_out: int = 16, per_record: int = 64, depth: int = 4,
                     train_records: bool = False, all_records: bool = False) -> dict:
    """The table of the module docstring for the drafters at ``hydra`` / ``eagle`` on the corpus
    ``data``, read through ``decoder``'s target (a SpeculativeDecoder on the runtime the drafters
    read hidden states from). "drafters": one entry per drafter, {"kind", "path", "greedy":
    P(first d guesses right) for d = 1.., "tree"} (``tuning.choice`` reads the shipped drafter's
    file to forecast which method is faster)."""
    from ..eagle import EagleDrafter
    from ..eagle.checkpoint import load_eagle
    from ..drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
    from ..drafters.proposers import proposer_for
    from ..heads.checkpoint import load_heads
    from ..tuning.choice import tree_accepts
    from .data import load_records
    from .eagle_features import FirstColumns
    from .eagle_train import answer_positions, compute_features, depth_accuracy, load_features, split_records

    if all_records and (train_records or features):
        raise ConfigError("--all-records measures a text no drafter trained on: without --train-records or --features")
    records = load_records(data)
    if not records:
        raise ConfigError(f"--data {data}: no corpus records there")
    held, _, seen = split_records(len(records), held_out)
    chosen = list(range(len(records))) if all_records else seen if train_records else held
    recs = [records[r] for r in chosen]
    target, V = decoder.target.model, decoder.target_backend.vocab_size
    eagles = [(path, load_eagle(path, target, dtype=torch.float32)) for path in eagle]
    layers = {m.config.fused_layers for _, m in eagles if m.config.fused_layers}
    if len(layers) > 1:
        raise ConfigError(f"EAGLE drafters reading different target layers ({sorted(layers)}): measure them in "
                          "separate runs")
    layers = layers.pop() if layers else ()
    if features:
        hidden, starts = load_features(features, records, layers)
        at = starts[chosen]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hidden, starts = load_features(compute_features(decoder.target_backend, recs, tmp, progress=False,
                                                            layers=layers), recs, layers)
            hidden = hidden[:]  # read into memory before the directory goes
        at = starts[:-1]
    final = FirstColumns(hidden, target.config.hidden_size) if layers else hidden  # the final state alone
    out = {"data": Path(data).name, "records": chosen, "per_record": per_record, "drafters": []}

    def shape(spec: str) -> DynamicTree:  # the method's default tree as decoding sizes it, without a lookup chain
        return dataclasses.replace(DynamicTree.parse(spec), nodes=DEFAULT_MAX_ROWS - 1)

    positions = answer_positions(recs, per_record)  # the positions heads_accuracy and depth_accuracy sample
    for path in hydra:
        heads = load_heads(path, target, dtype=torch.float32)
        if heads.config.context_size:
            raise ConfigError(f"{path}: heads with a context layer are not measured here")
        out["drafters"].append({"kind": "hydra", "path": Path(path).name,
                                "greedy": heads_accuracy(heads, recs, final, at, depth, per_record),
                                "tree": tree_accepts(DynamicTreeDrafter(proposer_for(heads, V),
                                                                        shape(DEFAULT_HYDRA_TREE), V),
                                                     recs, final, at, positions)})
    for path, model in eagles:
        states = hidden if model.config.fused_layers else final
        acc = depth_accuracy(model, recs, states, at, depth, per_record=per_record, top_k=(1, 4))
        tree = tree_accepts(EagleDrafter(model, shape(DEFAULT_EAGLE_TREE), V), recs, states, at, positions)
        out["drafters"].append({"kind": "eagle", "path": Path(path).name, "greedy": acc[1], "top4": acc[4],
                                "tree": tree})
    return out
