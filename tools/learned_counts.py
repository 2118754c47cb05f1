"""Counts (not time) of the drafting methods on Spec-Bench prompts, greedy: τ (tokens per target
call), α, verified rows per call and τ per verified row, for each method given.

    python tools/learned_counts.py --methods ar,lookup,recycle,suffix --per-group 2 --max-new-tokens 128 \
        --json-out benchmarks/DATE-learned-counts.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timezone


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="ar,lookup,auto,suffix,recycle")
    p.add_argument("--per-group", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cold", action="store_true", help="recycle: start from an empty table, saved nowhere")
    p.add_argument("--no-pacing", action="store_true", help="draft at every step (pacing off)")
    p.add_argument("--fixed", action="store_true", help="tree_budget fixed: trees not sized against the pass cost")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    from speculant.api import SpeculativeDecoder
    from speculant.specbench import load_questions
    from speculant.store.presets import DEFAULT_TARGET

    by_group = defaultdict(list)
    for q in load_questions():
        by_group[q["group"]].append(q)
    prompts = [q["turns"][0] for g in sorted(by_group) for q in by_group[g][:args.per_group]]
    rows = []
    for method in args.methods.split(","):
        dec = SpeculativeDecoder(DEFAULT_TARGET, method=method, chat=True, pacing=not args.no_pacing,
                                 tree_budget="fixed" if args.fixed else "auto")
        table = dec._parts.table
        if table is not None and args.cold:
            from speculant.drafters.recycling import RecycledTable

            object.__setattr__(dec._parts, "table", RecycledTable(table.V, table.k))
        calls = tokens = accepted = drafted = verified = 0
        for prompt in prompts:
            st = dec.generate(prompt, args.max_new_tokens).stats
            calls += st.target_calls
            tokens += st.new_tokens
            accepted += sum(st.accepted_per_call)
            drafted += sum(st.drafted_per_call)
            verified += st.verified_rows
        row = {"method": method, "resolved": dec.config.method, "prompts": len(prompts), "tokens": tokens,
               "target_calls": calls, "tau": tokens / calls, "alpha": accepted / drafted if drafted else 0.0,
               "rows_per_call": verified / calls, "tau_per_row": tokens / verified,
               "table_filled": dec._parts.table.filled if dec._parts.table is not None else None}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json_out:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json_out, "w") as f:
            json.dump({"command": " ".join(["python", "tools/learned_counts.py", *(argv or sys.argv[1:])]),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                       "cpu": next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if "Model name" in l), ""),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
