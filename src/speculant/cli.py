"""Command-line front end: argparse only; all work is done by the public API."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import SpeculantError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _decoder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="model directory, .gguf file or preset (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model for sd/mcsd (directory, .gguf or preset)")
    p.add_argument("--gamma", type=int, default=4, help="draft length for sd and lookup (default: %(default)s)")
    p.add_argument("--tree", default="2x1x1x1",
                   help="mcsd tree: a k-config like 2x1x1x1 (default) or 4x2x2x1, or a JSON list of paths")
    p.add_argument("--tree-file", default=None, help="medusa/mcsd: a JSON file with a list of paths")
    p.add_argument("--heads", default=None, help="medusa/bpd: a heads directory in the Medusa checkpoint layout")
    p.add_argument("--no-replacement", action="store_true", help="mcsd: draw candidates without replacement")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--draft-quant", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="weight-only quantization of the draft model; it cannot change the output, only the "
                        "speed (auto: int4 for bf16, default)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming it (or one JSON object with --json)")
    _decoder_args(g)
    g.add_argument("--method", choices=["ar", "sd", "mcsd", "lookup", "medusa", "bpd"], default="sd")
    _sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    g.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")

    b = sub.add_parser("bench", help="compare methods side by side on Spec-Bench prompts")
    _decoder_args(b)
    b.add_argument("--methods", default="ar,sd,mcsd,lookup,hf-assisted",
                   help="comma-separated: ar, sd, mcsd, lookup, hf-assisted (default: %(default)s)")
    b.add_argument("--per-category", type=int, default=1, help="prompts per Spec-Bench category")
    b.add_argument("--categories", default=None, help="comma-separated subset of categories")
    b.add_argument("--questions", default=None, help="a Spec-Bench-style JSONL file (default: the bundled one)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--json-out", default=None, help="write runs and summary as JSON to this file")

    d = sub.add_parser("demo", help="the default demo: 1.5B target, 0.5B draft, a coding prompt, speed-up over plain")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--method", choices=["sd", "mcsd"], default="mcsd")
    return parser


def _tree(args):
    """--tree-file (a JSON list of paths) wins over --tree."""
    if not args.tree_file:
        return args.tree
    from .errors import ConfigError

    try:
        with open(args.tree_file) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read --tree-file {args.tree_file}: {e.strerror}") from None


def cmd_generate(args) -> int:
    from .api import SpeculativeDecoder

    from .config import SamplingConfig
    from .errors import ConfigError

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # validate cheap arguments before loading any model
    SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not prompt.strip():
        raise ConfigError("the prompt is empty: give some text to continue")
    dec = SpeculativeDecoder(args.target, args.draft, method=args.method, gamma=args.gamma, tree=_tree(args),
                             replacement=not args.no_replacement, dtype=args.dtype, chat=args.chat,
                             draft_quant=args.draft_quant, heads=args.heads)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.json:
        result = dec.generate(prompt, args.max_new_tokens, **kw)
        print(json.dumps(result.to_dict()))
        return 0
    from rich.console import Console

    console = Console(highlight=False)
    color = console.is_terminal
    for ev in dec.stream(prompt, args.max_new_tokens, **kw):
        style = ("green" if ev.source == "draft" else "bold") if color else None
        console.print(ev.text, end="", style=style, markup=False, soft_wrap=True)
    console.print()
    s = dec.last_stats.to_dict()
    console.print(f"[{s['target_calls']} target calls, {s['tokens_per_call']:.2f} tokens/call, "
                  f"α={s['acceptance_rate']:.2f}, {s['tokens_per_s']:.2f} tokens/s"
                  + ("; green = accepted draft tokens" if color and args.method != "ar" else "") + "]",
                  style="dim", markup=False)
    return 0


def cmd_bench(args) -> int:
    from .bench.harness import BenchConfig, run_bench

    cfg = BenchConfig(target=args.target, draft=args.draft or DEFAULT_DRAFT, methods=tuple(args.methods.split(",")),
                      per_category=args.per_category, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                      tree=_tree(args), replacement=not args.no_replacement, dtype=args.dtype,
                      draft_quant=args.draft_quant,
                      categories=tuple(args.categories.split(",")) if args.categories else None,
                      questions=args.questions, json_out=args.json_out)
    run_bench(cfg)
    return 0


def cmd_demo(args) -> int:
    from .bench.demo import run_demo

    run_demo(args.max_new_tokens, args.method)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "demo": cmd_demo}[args.command](args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
