"""Same-run A/B of sequential heads with and without a context (prefix-attention) layer, on the
bench's 12 prompts (--per-category 2), interleaved: ar, hydra+lookup with heads A, hydra+lookup
with heads B (both with the default sized dynamic tree and the 8-token lookup chain).
Usage: python issue3-context-ab-s12.py HEADS_A HEADS_B"""
import sys
import time

import speculant
from speculant import SpeculativeDecoder
from speculant.bench.harness import load_questions, select
from speculant.models import chat_prompt

a_dir, b_dir = sys.argv[1:3]
tgt = speculant.load("qwen2.5-coder-1.5b-instruct", "bfloat16")
decs = {"ar": SpeculativeDecoder(tgt, method="ar"),
        "hydra+lookup A": SpeculativeDecoder(tgt, method="hydra", lookup_branch=8, heads=a_dir),
        "hydra+lookup B": SpeculativeDecoder(tgt, method="hydra", lookup_branch=8, heads=b_dir)}
qs = select(load_questions(), 2, None)
tok = tgt.tokenizer
enc = [tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0] for q in qs]
for d in decs.values():
    d.generate(enc[0], 8)
tot = {k: [0, 0.0, 0] for k in decs}
same = {k: 0 for k in decs}
for i, ids in enumerate(enc):
    order = list(decs) if i % 2 == 0 else list(reversed(decs))
    out = {}
    for k in order:
        t = time.perf_counter(); r = decs[k].generate(ids, 128); dt = time.perf_counter() - t
        tot[k][0] += len(r.token_ids); tot[k][1] += dt; tot[k][2] += r.stats.to_dict()["target_calls"]
        out[k] = r.token_ids
    for k in decs:
        same[k] += out[k] == out["ar"]
    print(i, qs[i]["category"], {k: round(v[0] / v[1], 2) for k, v in tot.items()}, flush=True)
ar = tot["ar"][0] / tot["ar"][1]
print("A =", a_dir, " B =", b_dir)
for k, (n, w, c) in tot.items():
    print(f"{k:16s} {n / w:.2f} tok/s  {n / w / ar:.3f}x  tau {n / c:.3f}  same as ar {same[k]}/{len(enc)}")
