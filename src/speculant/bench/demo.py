"""`make demo`: the 1.5B target on a coding prompt, on this CPU's fastest lossless setup (the
default: ``auto``), against plain decoding on the same runtime, side by side; other methods on
request (the 0.5B draft for sd/mcsd, the shipped heads for medusa/hydra)."""

from __future__ import annotations

from rich.console import Console

from ..api import SpeculativeDecoder, load_native
from ..config import DEFAULT_LOOKUP_BRANCH
from ..defaults import choose_runtime
from ..errors import ConfigError
from ..store.models import load

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"

PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
          "and returns them sorted. Include a docstring and a short example.")
DEMO_METHODS = ("auto", "lookup", "sd", "mcsd", "medusa", "medusa+lookup", "hydra", "hydra+lookup")


def parse_methods(spec: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in spec.split(",") if m.strip())
    bad = [m for m in methods if m not in DEMO_METHODS]
    if not methods or bad:
        raise ConfigError(f"demo methods must be a comma-separated list of {', '.join(DEMO_METHODS)}; got {spec!r}")
    return methods


def run_demo(max_new_tokens: int = 128, methods: str = "auto") -> None:
    chosen = parse_methods(methods)
    if max_new_tokens < 1:  # before the models load
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    console = Console()
    rt = choose_runtime(TARGET, "bfloat16")
    console.print("[bold]speculant demo[/bold]: Qwen2.5-Coder-1.5B-Instruct (0.5B draft for sd/mcsd; the shipped "
                  f"heads for medusa/hydra), greedy; {rt.why}")
    if rt.backend == "native":
        target = load_native(TARGET, "bfloat16", rt.target_quant, rt.quant_head)
        draft = load_native(DRAFT, "bfloat16", "int4") if {"sd", "mcsd"} & set(chosen) else None
    else:
        target = load(TARGET, "bfloat16")
        draft = load(DRAFT, "bfloat16") if {"sd", "mcsd"} & set(chosen) else None
    plain = SpeculativeDecoder(target, method="ar", chat=True)
    decoders = {}
    for name in chosen:
        method, _, lookup = name.partition("+")
        if method == "auto":
            decoders[name] = SpeculativeDecoder(target, chat=True)
            console.print(f"[dim]auto = {decoders[name].why}[/dim]")
        elif method in ("sd", "mcsd"):
            decoders[name] = SpeculativeDecoder(target, draft, method=method, gamma=4, tree="2x1x1x1", chat=True,
                                                draft_quant="none" if rt.backend == "native" else "auto")
        else:
            decoders[name] = SpeculativeDecoder(target, method=method,
                                                lookup_branch=DEFAULT_LOOKUP_BRANCH if lookup else 0, chat=True)
    for dec in (plain, *decoders.values()):  # warm-up
        dec.generate(PROMPT, 4)
    console.print(f"[dim]prompt:[/dim] {PROMPT}\n")
    r_plain = plain.generate(PROMPT, max_new_tokens)
    results = {name: dec.generate(PROMPT, max_new_tokens) for name, dec in decoders.items()}
    console.print(r_plain.text, markup=False, highlight=False)
    a = r_plain.stats.to_dict()
    console.print()
    console.print(f"plain decoding : {a['tokens_per_s']:6.2f} tokens/s ({len(r_plain.token_ids)} tokens, "
                  f"{a['wall_s']:.1f} s)")
    for name, r in results.items():
        s = r.stats.to_dict()
        console.print(f"{name:<15}: {s['tokens_per_s']:6.2f} tokens/s ({len(r.token_ids)} tokens, "
                      f"{s['wall_s']:.1f} s), {s['tokens_per_call']:.2f} tokens per target call; "
                      f"[bold]{s['tokens_per_s'] / a['tokens_per_s']:.2f}x[/bold] over plain decoding")
        n = min(len(r.token_ids), len(r_plain.token_ids))
        same = next((i for i, (x, y) in enumerate(zip(r.token_ids, r_plain.token_ids)) if x != y), n)
        if s["plain_steps"]:
            console.print(f"                 {s['plain_steps']} of {s['target_calls']} steps ran without drafting "
                          "(it did not pay there)")
        if r.token_ids == r_plain.token_ids:
            console.print("                 output identical to plain decoding")
        else:
            console.print(f"                 output identical to plain decoding for the first {same} tokens: on the "
                          "transformers runtime in bf16 a multi-token verification pass can round a near-tie "
                          "differently from a one-token pass (the native runtime's passes are row-invariant; "
                          "see README)", style="dim")
    console.print("[dim](speed-ups measured side by side in this run; they depend on the CPU: see README)[/dim]")
