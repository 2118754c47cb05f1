"""`make demo`: the 1.5B target with the 0.5B draft on a coding prompt, against plain decoding."""

from __future__ import annotations

from rich.console import Console

from ..api import SpeculativeDecoder
from ..models import load

PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
          "and returns them sorted. Include a docstring and a short example.")


def run_demo(max_new_tokens: int = 128, method: str = "mcsd") -> None:
    console = Console()
    console.print("[bold]speculant demo[/bold]: Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, bf16, greedy")
    target = load("qwen2.5-coder-1.5b-instruct", "bfloat16")
    draft = load("qwen2.5-coder-0.5b-instruct", "bfloat16")
    plain = SpeculativeDecoder(target, method="ar", chat=True)
    spec = SpeculativeDecoder(target, draft, method=method, gamma=4, tree="2x1x1x1", chat=True)
    plain.generate(PROMPT, 4), spec.generate(PROMPT, 4)  # warm-up
    console.print(f"[dim]prompt:[/dim] {PROMPT}\n")
    r_spec = spec.generate(PROMPT, max_new_tokens)
    r_plain = plain.generate(PROMPT, max_new_tokens)
    console.print(r_spec.text, markup=False, highlight=False)
    s, a = r_spec.stats.to_dict(), r_plain.stats.to_dict()
    console.print()
    console.print(f"plain decoding : {a['tokens_per_s']:6.2f} tokens/s ({len(r_plain.token_ids)} tokens, {a['wall_s']:.1f} s)")
    console.print(f"{method:<15}: {s['tokens_per_s']:6.2f} tokens/s ({len(r_spec.token_ids)} tokens, {s['wall_s']:.1f} s), "
                  f"{s['tokens_per_call']:.2f} tokens per target call, acceptance {s['acceptance_rate']:.2f}")
    console.print(f"[bold]speed-up over plain decoding: {s['tokens_per_s'] / a['tokens_per_s']:.2f}x[/bold] "
                  "(measured side by side in this run)")
    n = min(len(r_spec.token_ids), len(r_plain.token_ids))
    same = next((i for i, (x, y) in enumerate(zip(r_spec.token_ids, r_plain.token_ids)) if x != y), n)
    if r_spec.token_ids == r_plain.token_ids:
        console.print("output identical to plain decoding")
    else:
        console.print(f"output identical to plain decoding for the first {same} tokens: in bf16 a multi-token "
                      "verification pass can round a near-tie differently from a one-token pass; with "
                      "--dtype float32 greedy output is identical (see README)", style="dim")
