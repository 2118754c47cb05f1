"""Pick the static tree shipped beside trained heads (``tree.json``) and write ``calibration.json``.

Measures the heads' top-i accuracies at every depth on their held-out records (``held_out.jsonl``,
written by ``speculant train-heads``; with ``--only FILE``, only the held-out records whose prompt
is in that distillation file), builds the greedy Medusa tree for several node budgets, and keeps
the budget with the best expected tokens per call over the target's cost per verification pass
(or the one ``--budget`` names). ``speculant build-tree`` does the measuring and the tree for one
budget; this script adds the budget sweep against a fixed cost model.

Cost models (ms per target pass over n tokens, measured on a 2-core Intel Xeon with AMX for
Qwen2.5-Coder-1.5B):

- ``bf16``: the transformers bf16 pass (255 ms up to 8 tokens, 268 at 16, 380 at 45), plus ~35 ms
  for Medusa heads;
- ``native``: the native int4 pass (67 ms at 1 token, 82 at 8, 98 at 16, 114 at 20), plus ~8 ms.

Sequential heads pay one output-layer projection per tree depth instead (``--head-ms-per-depth``,
default 9 for bf16 and 4 for native, measured for a 32k-token draft vocabulary). On another CPU,
the decoder's own tree sizing (``--tree-budget auto``) measures the pass cost itself.

    python tools/pick_tree.py HEADS_DIR [--only FILE] [--cost bf16|native] [--budget N] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BUDGETS = (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40)


def pass_ms(n: int, cost: str) -> float:
    """ms per target pass over ``n`` tokens, without the heads (see the module docstring)."""
    if cost == "native":
        return 67 + (n - 1) * 15 / 7 if n <= 8 else 82 + (n - 8) * 2 if n <= 16 else 98 + (n - 16) * 4
    return 255 if n <= 8 else 255 + (n - 8) * 13 / 8 if n <= 16 else 268 + (n - 16) * 112 / 29


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("heads_dir", help="a heads directory written by `speculant train-heads`")
    ap.add_argument("--only", help="use only the held-out records whose prompt is in this distillation JSONL")
    ap.add_argument("--cost", choices=["bf16", "native"], default="bf16", help="cost model (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="print, write nothing")
    ap.add_argument("--budget", type=int, default=None, help="ship this budget instead of the cost model's best")
    ap.add_argument("--head-ms-per-depth", type=float, default=None, help="sequential heads: ms per tree depth")
    args = ap.parse_args(argv)

    import torch

    from speculant.heads import load_heads
    from speculant.store.models import load
    from speculant.training.accuracy import head_topk_accuracy
    from speculant.training.data import load_records
    from speculant.trees.search import expected_length, greedy_tree

    heads_dir = Path(args.heads_dir)
    config = heads_dir / "config.json"
    if not config.is_file():
        raise SystemExit(f"pick_tree: {config} not found: give a heads directory written by `speculant train-heads`")
    base = json.loads(config.read_text())["base_model_name_or_path"]
    target = load(base, "bfloat16")
    heads = load_heads(str(heads_dir), target.model)
    recs = load_records(heads_dir / "held_out.jsonl")
    if args.only:
        keep = {r["prompt"] for r in load_records(args.only)}
        recs = [r for r in recs if r["prompt"] in keep]
    print("calibration records", len(recs))
    with torch.inference_mode():
        acc, counts = head_topk_accuracy(target, heads, [r["ids"] for r in recs], 10,
                                         prompt_lens=[r["prompt_len"] for r in recs], return_counts=True)
    print("positions", counts)
    for k, row in enumerate(acc):
        print(f"head {k}: top1 {row[0]:.3f} top5 {sum(row[:5]):.3f} top10 {sum(row):.3f}")

    medusa_ms = 8 if args.cost == "native" else 35
    per_depth = args.head_ms_per_depth or (4 if args.cost == "native" else 9)

    def heads_ms(paths) -> float:
        if getattr(heads, "conditioned", False):
            return per_depth * max(len(p) for p in paths)
        return medusa_ms

    best = None
    for b in BUDGETS:
        paths = greedy_tree(acc, b)
        tau = 1 + expected_length(paths, acc)
        est = tau * pass_ms(1, args.cost) / (pass_ms(len(paths) + 1, args.cost) + heads_ms(paths))
        print(f"budget {b:3d}: tau {tau:.3f}  est speedup {est:.2f}")
        if best is None or est > best[0]:
            best = (est, b, paths)
    print("best", best[:2])
    if args.budget:
        best = (None, args.budget, greedy_tree(acc, args.budget))
        print("shipping budget", args.budget, best[2])
    if args.dry_run:
        return
    (heads_dir / "calibration.json").write_text(
        json.dumps({"accuracies": acc, "positions": counts, "best_budget": best[1]}, indent=1))
    (heads_dir / "tree.json").write_text(json.dumps(best[2]) + "\n")


if __name__ == "__main__":
    main()
