import time, torch
from transformers import AutoTokenizer
from speculant.models import resolve, chat_prompt
from speculant.bench.llamacpp import LlamaCppPlain
tok = AutoTokenizer.from_pretrained(str(resolve("qwen2.5-coder-1.5b-instruct")))
ids = tok(chat_prompt(tok, "Write a Python function that merges overlapping intervals."), add_special_tokens=False, return_tensors="pt").input_ids[0]
r = LlamaCppPlain("qwen2.5-coder-1.5b-instruct", tok, n_threads=1)
res = {}
for n in (1, 65, 1, 65):
    t, w = time.process_time(), time.perf_counter()
    out, _ = r.run(ids, n)
    res.setdefault(n, []).append((time.process_time() - t, time.perf_counter() - w, len(out)))
print("prompt tokens", len(ids), res)
pre = min(c for c, _, _ in res[1]); full = min(c for c, _, _ in res[65])
print(f"llama.cpp 1 thread: prefill+1 token {pre*1e3:.0f} CPU ms; decode {(full - pre) / 64 * 1e3:.1f} CPU ms/token")
