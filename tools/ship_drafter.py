"""Ship a newly trained EAGLE drafter for the default target only if it guesses better than the one
shipped, on text neither trained on: the target's greedy answers to the Spec-Bench questions the
bench does not use (``tools/teacher_forced_tau.py gen``).

    python tools/ship_drafter.py CANDIDATE_DIR --dev DEV.jsonl [--dry-run]

Both drafters (and the shipped sequential heads, whose row auto's forecast reads beside the
EAGLE drafter's) are measured on the same answer positions (``speculant drafter-accuracy
--all-records``), on answers from every one of the 13 categories (a drafter that is better on a
few kinds of text can be slower on the rest). The candidate ships when its greedy chain is right
more often at depth 1 and at depth 2, and should then be benched (``speculant bench`` with
``eagle+lookup@heads=OLD`` beside ``auto``) before it is committed: its files replace ``data/drafters/<target>/eagle`` (with the new ``accuracy.json``), and
``data/manifest.json`` and the cache's copy are updated (``tools/data_manifest.py``). Either way the
comparison is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "qwen2.5-coder-1.5b-instruct"
CATEGORIES = 13  # Spec-Bench's categories, each with answers in the comparison


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("candidate", help="the trained drafter (train-drafter's OUT/drafter)")
    p.add_argument("--dev", required=True, help="the target's answers to held-out questions (JSONL)")
    p.add_argument("--shipped", default=str(ROOT / "data" / "drafters" / TARGET / "eagle"))
    p.add_argument("--heads", default=str(ROOT / "data" / "drafters" / TARGET / "sequential"))
    p.add_argument("--dry-run", action="store_true", help="compare only")
    args = p.parse_args()

    from speculant import SpeculativeDecoder
    from speculant.training.drafter_accuracy import drafter_accuracy

    cats = {json.loads(line).get("cat") for line in open(args.dev) if line.strip()}
    if len(cats) < CATEGORIES and not args.dry_run:  # a drafter better on a few kinds of text can be slower overall
        sys.exit(f"{args.dev} has answers of {len(cats)} of Spec-Bench's {CATEGORIES} categories: generate all of "
                 "them (teacher_forced_tau.py gen), or compare with --dry-run")

    dec = SpeculativeDecoder(TARGET, method="ar")
    both = drafter_accuracy(dec, args.dev, [args.heads], [args.shipped, args.candidate], all_records=True)
    hydra, shipped, candidate = both["drafters"]
    better = all(candidate["greedy"][d] > shipped["greedy"][d] for d in (0, 1))
    report = {"shipped": shipped["greedy"], "candidate": candidate["greedy"], "heads": hydra["greedy"],
              "records": len(both["records"]), "per_record": both["per_record"], "ships": better and not args.dry_run}
    print(json.dumps(report, indent=1))
    if not better or args.dry_run:
        return 0
    new = Path(args.shipped + ".new")
    if new.exists():
        shutil.rmtree(new)
    new.mkdir()
    for f in Path(args.candidate).iterdir():  # the drafter's own files, not a training run's features or checkpoints
        if f.is_file():
            shutil.copy2(f, new / f.name)
    _as_bf16(new)
    accuracy = {**both, "drafters": [hydra, {**candidate, "path": "eagle"}]}
    (new / "accuracy.json").write_text(json.dumps(accuracy, indent=1) + "\n")
    shutil.rmtree(args.shipped)
    new.replace(args.shipped)
    for step in ("write", "install"):
        subprocess.run([sys.executable, str(ROOT / "tools" / "data_manifest.py"), step], check=True)
    return 0


def _as_bf16(directory: Path) -> None:
    """Store the drafter's float weights in bfloat16 (train-eagle keeps float32): half the file.
    load_eagle casts them to the output layer's dtype, bfloat16 on the native runtime, so there
    the drafter is the one the comparison above measured."""
    import torch
    from safetensors.torch import load_file

    from speculant.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, floats_in, write_checkpoint

    state = floats_in(load_file(str(directory / WEIGHTS_NAME)), torch.bfloat16)
    write_checkpoint(directory, state, json.loads((directory / CONFIG_NAME).read_text()), "the drafter")


if __name__ == "__main__":
    raise SystemExit(main())
