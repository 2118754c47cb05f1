"""How often an answer served from the prefix cache differs from the same request's cold answer.

Plays the sessions of a sessions file (``bench.sessions``; ``default``: the shipped one) turn by
turn on one decoder, greedy, every turn carrying the whole history (the chat template over the
system prompt, the tools, the earlier turns and the decoder's own earlier answers). Each turn is
generated twice from the same prompt token ids: from the prefix cache (the history's blocks
cached by the earlier turns) and cold (``cache_prompt=False``: the whole prompt prefilled). The
history goes on with the cached answer. Written per turn: prompt and cached tokens, whether the
two answers are the same tokens, and where they first differ.

With the prefix cache on, the native runtime prefills prompts on its decoding kernels on CPUs
without AMX, so there the two must agree. On AMX CPUs a cold prompt of >= 96 tokens is prefilled
on widened bf16 weights and flash attention by default, a cached continuation on the row-invariant
kernels, so the two can differ in the last bits and, rarely, in a token; with ``--exact-prefill``
(``SPECULANT_EXACT_PREFILL=1``) every prompt runs on the decoding kernels and they must agree.

    python tools/prefix_exactness.py --json-out benchmarks/DATE-CPU-prefix-exactness.json
    python tools/prefix_exactness.py --exact-prefill --kinds chat,mt_bench --json-out ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="the target model (default: the default preset)")
    p.add_argument("--method", default="auto")
    p.add_argument("--sessions", default="default")
    p.add_argument("--kinds", default=None, help="only these kinds, comma-separated (chat, coding, agent, mt_bench)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sessions (after --kinds)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--exact-prefill", action="store_true", help="SPECULANT_EXACT_PREFILL=1: prompts on the decoding "
                   "kernels, so cached and cold answers must agree")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.exact_prefill:
        os.environ["SPECULANT_EXACT_PREFILL"] = "1"
    else:
        os.environ.pop("SPECULANT_EXACT_PREFILL", None)

    import torch

    from speculant.api import SpeculativeDecoder
    from speculant.bench.sessions import Answer, load_sessions, select_sessions, turn_messages
    from speculant.provenance import git_info, machine_info, provenance
    from speculant.store.chat import chat_messages_prompt
    from speculant.store.presets import DEFAULT_TARGET

    before = git_info()
    kinds = tuple(k for k in args.kinds.split(",") if k) if args.kinds else None
    sessions = select_sessions(load_sessions(args.sessions), kinds, args.limit)
    dec = SpeculativeDecoder(args.target or DEFAULT_TARGET, method=args.method, chat=True)
    if dec.prefix_cache is None:
        raise SystemExit("this decoder has no prefix cache (not the native runtime, or cache_ram 0)")
    rows, t0 = [], time.perf_counter()
    for s in sessions:
        answers: list[Answer] = []
        for k in range(len(s.turns)):
            text = chat_messages_prompt(dec.tokenizer, turn_messages(s, answers), list(s.tools) if s.tools else None)
            ids = torch.tensor(dec.tokenizer(text, add_special_tokens=False).input_ids)
            warm = dec.start(ids, args.max_new_tokens).result()
            cold = dec.start(ids, args.max_new_tokens, cache_prompt=False).result()
            a, b = warm.token_ids, cold.token_ids
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
            rows.append({"session": s.id, "kind": s.kind, "turn": k + 1, "prompt_tokens": int(ids.shape[0]),
                         "cached_tokens": warm.stats.cached_tokens, "same": a == b, "first_difference": first,
                         "tokens": len(a)})
            print(json.dumps(rows[-1]), flush=True)
            answers.append(Answer(warm.text))
    cached_turns = [r for r in rows if r["cached_tokens"]]
    summary = {"turns": len(rows), "turns_from_cache": len(cached_turns),
               "same_from_cache": sum(r["same"] for r in cached_turns),
               "same_all": sum(r["same"] for r in rows)}
    print(json.dumps(summary), flush=True)
    out = {"command": " ".join(["python", "tools/prefix_exactness.py", *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
           "source": provenance(before, git_info()), "method": dec.config.method, "why": dec.why,
           "exact_prefill": args.exact_prefill, "max_new_tokens": args.max_new_tokens,
           "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "turns": rows}
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
