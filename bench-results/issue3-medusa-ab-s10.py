"""Same-run A/B of Medusa heads' trees on 6 bench prompts (one per category), interleaved:
ar, medusa+lookup with its static 14-node tree, and with a dynamic tree sized per step
(tree="dynamic", tree_budget="auto"; the lookup chain 8 tokens, as the bench's)."""
import time
import speculant
from speculant import SpeculativeDecoder
from speculant.bench.harness import load_questions, select
from speculant.models import chat_prompt
tgt = speculant.load("qwen2.5-coder-1.5b-instruct", "bfloat16")
decs = {"ar": SpeculativeDecoder(tgt, method="ar"),
        "medusa+lookup static": SpeculativeDecoder(tgt, method="medusa", lookup_branch=8),
        "medusa+lookup sized": SpeculativeDecoder(tgt, method="medusa", lookup_branch=8, tree="dynamic:23:4")}
qs = select(load_questions(), 1, None)
tok = tgt.tokenizer
enc = [tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0] for q in qs]
for d in decs.values():
    d.generate(enc[0], 8)
tot = {k: [0, 0.0, 0] for k in decs}
for i, ids in enumerate(enc):
    order = list(decs) if i % 2 == 0 else list(reversed(decs))
    for k in order:
        t = time.perf_counter(); r = decs[k].generate(ids, 128); dt = time.perf_counter() - t
        tot[k][0] += len(r.token_ids); tot[k][1] += dt; tot[k][2] += r.stats.to_dict()["target_calls"]
    print(i, {k: round(v[0] / v[1], 2) for k, v in tot.items()}, flush=True)
ar = tot["ar"][0] / tot["ar"][1]
for k, (n, w, c) in tot.items():
    print(k, f"{n / w:.2f} tok/s", f"{n / w / ar:.3f}x", f"tau {n / c:.3f}")
