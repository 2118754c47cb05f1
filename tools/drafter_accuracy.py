"""Greedy-chain accuracy by depth of sequential heads (Hydra) and EAGLE drafters, on the same
held-out positions of a corpus, so the two kinds of drafter are compared on exactly the same text.

The records are those ``train-eagle`` holds out (``eagle.train.split_records``: ``--held-out``
records spread over the corpus), read with the target features ``train-eagle`` cached in ``DIR/features``
(``--features``); without them, the target computes the features of the measured records alone.
At each sampled answer position i the drafter starts from the target's state h_i and the token
x_{i+1} and guesses x_{i+2}, x_{i+3}, ...; depth d counts while its first d guesses are all the
target's own tokens (``eagle.train.depth_accuracy``'s measure; sequential heads follow the same
walk with their own states).

    python tools/drafter_accuracy.py --data corpus.jsonl [--features RUN/features] \\
        --hydra src/speculant/data/heads/qwen2.5-coder-1.5b-instruct/sequential --eagle RUN [RUN2 ...]

``--all-records`` measures every record of a text no drafter trained on: the forecast's table for
the shipped drafter comes from the target's greedy answers to the Spec-Bench questions the bench
does not use (``tools/teacher_forced_tau.py gen``), text like what users ask, where the drafters
are accepted far less often than on their corpora's held-out records:

    python tools/teacher_forced_tau.py gen dev.jsonl --questions 2,3,4,5 --max-new-tokens 128
    python tools/drafter_accuracy.py --data dev.jsonl --all-records --hydra HEADS --eagle RUN

``--train-records`` measures training records instead (the same number, spread over the rest):
the gap to the held-out figure is what a drafter memorised.

Each drafter's ``tree`` table is what ``speculant.drafters.choice`` forecasts from: at the same
positions, the drafter grows the dynamic tree it drafts with in decoding (its method's default
shape, no lookup chain), and tree[d-1][m-1] is the mean number of its tokens the target's own
continuation accepts when the tree is cut to depth d and to its m best-scored nodes.
"""
import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from speculant.api import SpeculativeDecoder
from speculant.config import DEFAULT_EAGLE_TREE, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS
from speculant.drafters.choice import tree_accepts
from speculant.drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
from speculant.eagle import EagleDrafter
from speculant.eagle.checkpoint import load_eagle
from speculant.eagle.train import answer_positions, compute_features, depth_accuracy, load_features, split_records
from speculant.heads.checkpoint import load_heads
from speculant.training.data import load_records


@torch.no_grad()
def heads_accuracy(heads, records, hidden, starts, depth: int, per_record: int, seed: int = 0) -> list[float]:
    """depth_accuracy's measure for sequential heads: s_0 = h_i, s_d = step(s_{d-1}, x_{i+d})."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the corpus JSONL the features were computed for")
    ap.add_argument("--features", help="train-eagle's DIR/features (default: computed for the measured records)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--hydra", nargs="*", default=[], help="sequential heads directories")
    ap.add_argument("--eagle", nargs="*", default=[], help="EAGLE drafter directories")
    ap.add_argument("--held-out", type=int, default=16, help="train-eagle's --held-out")
    ap.add_argument("--per-record", type=int, default=64, help="answer positions sampled per record")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--train-records", action="store_true", help="measure training records instead")
    ap.add_argument("--all-records", action="store_true",
                    help="measure every record (a text no drafter trained on, e.g. teacher_forced_tau.py gen's)")
    args = ap.parse_args()
    if args.all_records and (args.train_records or args.features):
        raise SystemExit("--all-records measures a text no drafter trained on: without --train-records or --features")

    records = load_records(args.data)
    held, _, seen = split_records(len(records), args.held_out)
    chosen = list(range(len(records))) if args.all_records else seen if args.train_records else held
    recs = [records[r] for r in chosen]
    dec = SpeculativeDecoder(args.target, method="ar")  # the runtime train-eagle reads the features from
    target, V = dec.target.model, dec.target_backend.vocab_size
    if args.features:
        hidden, starts = load_features(args.features, records)
        at = starts[chosen]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hidden, starts = load_features(compute_features(dec.target_backend, recs, tmp, progress=False), recs)
        at = starts[:-1]
    # "drafters": one entry per drafter, {"kind", "path", "greedy": P(first d guesses right) for d = 1..,
    # "tree": the table of the module doc} (speculant.drafters.choice reads the shipped drafter's file
    # to forecast which method is faster)
    out = {"data": Path(args.data).name, "records": chosen, "per_record": args.per_record, "drafters": []}

    def shape(spec: str) -> DynamicTree:  # the method's default tree as decoding sizes it, without a lookup chain
        return dataclasses.replace(DynamicTree.parse(spec), nodes=DEFAULT_MAX_ROWS - 1)

    positions = answer_positions(recs, args.per_record)  # the positions heads_accuracy and depth_accuracy sample
    for path in args.hydra:
        heads = load_heads(path, target, dtype=torch.float32)
        if getattr(heads, "context", None) is not None:
            raise SystemExit(f"{path}: heads with a context layer are not measured here")
        out["drafters"].append({"kind": "hydra", "path": Path(path).name,
                                "greedy": heads_accuracy(heads, recs, hidden, at, args.depth, args.per_record),
                                "tree": tree_accepts(DynamicTreeDrafter(heads, shape(DEFAULT_HYDRA_TREE), V),
                                                     recs, hidden, at, positions)})
    for path in args.eagle:
        model = load_eagle(path, target, dtype=torch.float32)
        acc = depth_accuracy(model, recs, hidden, at, args.depth, per_record=args.per_record, top_k=(1, 4))
        tree = tree_accepts(EagleDrafter(model, shape(DEFAULT_EAGLE_TREE), V), recs, hidden, at, positions)
        out["drafters"].append({"kind": "eagle", "path": Path(path).name, "greedy": acc[1], "top4": acc[4],
                                "tree": tree})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
