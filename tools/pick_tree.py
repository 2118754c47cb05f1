"""Pick the shipped tree: per-head top-i accuracies of trained heads on their held-out records
(``held_out.jsonl``; with ``--only FILE``, only the held-out records whose prompt is in that
distillation file), the greedy Medusa tree for several node budgets, and the budget whose expected
tokens per call over the target's cost per verification pass is best. Cost models (ms per pass of
n tokens, measured on the project machine): ``bf16`` the transformers bf16 Qwen2.5-Coder-1.5B pass
(issue 2: 255 ms up to 8 tokens, 268 at 16, 380 at 45) plus ~35 ms for the heads; ``native`` the
native int4 pass (steptime: 67 ms at 1 token, 82 at 8, 98 at 16, 114 at 20) plus ~8 ms for the
heads. Sequential heads (``--head-ms-per-depth``, default 9 bf16 / 4 native, measured for a
32k-token draft vocabulary) pay one output-layer projection per tree depth instead. Writes
``tree.json`` and ``calibration.json`` unless ``--dry-run``.

    python tools/pick_tree.py HEADS_DIR [--only FILE] [--cost bf16|native] [--budget N] [--dry-run]
"""
import argparse, json, sys, torch
from speculant.models import load
from speculant.heads import load_heads
from speculant.training.accuracy import head_topk_accuracy
from speculant.training.data import load_records
from speculant.tree_search import greedy_tree, expected_length

ap = argparse.ArgumentParser()
ap.add_argument("heads_dir"); ap.add_argument("--only"); ap.add_argument("--cost", default="bf16")
ap.add_argument("--dry-run", action="store_true")
ap.add_argument("--budget", type=int, default=None, help="ship this budget instead of the cost model's best")
ap.add_argument("--head-ms-per-depth", type=float, default=None, help="sequential heads: ms per tree depth")
args = ap.parse_args()
heads_dir = args.heads_dir
base = json.load(open(f"{heads_dir}/config.json"))["base_model_name_or_path"]
target = load(base, "bfloat16")
heads = load_heads(heads_dir, target.model)
recs = load_records(f"{heads_dir}/held_out.jsonl")
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

HEADS_MS = 8 if args.cost == "native" else 35
PER_DEPTH = args.head_ms_per_depth or (4 if args.cost == "native" else 9)


def heads_ms(paths):
    if getattr(heads, "conditioned", False):
        return PER_DEPTH * max(len(p) for p in paths)
    return HEADS_MS


def cost(n):  # ms per target pass over n tokens (without the heads)
    if args.cost == "native":
        return 67 + (n - 1) * 15 / 7 if n <= 8 else 82 + (n - 8) * 2 if n <= 16 else 98 + (n - 16) * 4
    return 255 if n <= 8 else 255 + (n - 8) * 13 / 8 if n <= 16 else 268 + (n - 16) * 112 / 29
best = None
for b in (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40):
    paths = greedy_tree(acc, b)
    tau = 1 + expected_length(paths, acc)
    est = tau * cost(1) / (cost(len(paths) + 1) + heads_ms(paths))
    print(f"budget {b:3d}: tau {tau:.3f}  est speedup {est:.2f}")
    if best is None or est > best[0]:
        best = (est, b, paths)
print("best", best[:2])
if args.budget:
    best = (None, args.budget, greedy_tree(acc, args.budget))
    print("shipping budget", args.budget, best[2])
if args.dry_run:
    sys.exit()
json.dump({"accuracies": acc, "positions": counts, "best_budget": best[1]}, open(f"{heads_dir}/calibration.json", "w"), indent=1)
open(f"{heads_dir}/tree.json", "w").write(json.dumps(best[2]) + "\n")
