"""Same-run A/B of hydra+lookup trees on the bench's 12 prompts: ar, 16 rows (default), 29 rows (session 8)."""
import json, time
import speculant
from speculant import SpeculativeDecoder
from speculant.bench.harness import load_questions, select
from speculant.models import chat_prompt
tgt = speculant.load("qwen2.5-coder-1.5b-instruct", "bfloat16")
decs = {"ar": SpeculativeDecoder(tgt, method="ar"),
        "h16": SpeculativeDecoder(tgt, method="hydra", lookup_branch=8),
        "h29": SpeculativeDecoder(tgt, method="hydra", lookup_branch=12, tree="dynamic:16:3")}
print({k: (d.dynamic.nodes, d.dynamic.depth) if d.dynamic else None for k, d in decs.items()})
qs = select(load_questions(), 2, None)
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
