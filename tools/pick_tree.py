"""Pick the shipped tree: per-head top-i accuracies of trained heads on their held-out records
(``held_out.jsonl``), the greedy Medusa tree for several node budgets, and the budget whose expected
tokens per call over the target's cost per verification pass is best. The cost model is the
bf16 Qwen2.5-Coder-1.5B pass time measured on the project machine (issue 2: 255 ms up to 8 tokens,
268 at 16, 380 at 45) plus ~35 ms for the heads. Writes ``tree.json`` and ``calibration.json``.

    python tools/pick_tree.py HEADS_DIR
"""
import json, sys, torch
from speculant.models import load
from speculant.heads import load_heads
from speculant.training.accuracy import head_topk_accuracy
from speculant.training.data import load_records
from speculant.tree_search import greedy_tree, expected_length

heads_dir = sys.argv[1]
base = json.load(open(f"{heads_dir}/config.json"))["base_model_name_or_path"]
target = load(base, "bfloat16")
heads = load_heads(heads_dir, target.model)
recs = load_records(f"{heads_dir}/held_out.jsonl")
with torch.inference_mode():
    acc, counts = head_topk_accuracy(target, heads, [r["ids"] for r in recs], 10,
                                     prompt_lens=[r["prompt_len"] for r in recs], return_counts=True)
print("positions", counts)
for k, row in enumerate(acc):
    print(f"head {k}: top1 {row[0]:.3f} top5 {sum(row[:5]):.3f} top10 {sum(row):.3f}")

def cost(n):  # ms per target pass over n tokens (bf16, measured in issue 2) + ~35 ms of heads
    t = 255 if n <= 8 else 255 + (n - 8) * 13 / 8 if n <= 16 else 268 + (n - 16) * 112 / 29
    return t + 35
best = None
for b in (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40):
    paths = greedy_tree(acc, b)
    tau = 1 + expected_length(paths, acc)
    est = tau * 255 / cost(len(paths) + 1)
    print(f"budget {b:3d}: tau {tau:.3f}  est speedup {est:.2f}")
    if best is None or est > best[0]:
        best = (est, b, paths)
print("best", best[:2])
json.dump({"accuracies": acc, "positions": counts, "best_budget": best[1]}, open(f"{heads_dir}/calibration.json", "w"), indent=1)
open(f"{heads_dir}/tree.json", "w").write(json.dumps(best[2]) + "\n")
