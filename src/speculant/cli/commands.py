"""Command-line front end: argparse only; all work is done by the public API."""

from __future__ import annotations

import argparse
import json
import sys

from .training import (add_training_parsers, cmd_build_tree, cmd_cut_vocab, cmd_export_eagle, cmd_export_heads,
                           cmd_make_conversations, cmd_make_corpus, cmd_train_eagle, cmd_train_heads)
from .chat import add_chat_options, cmd_chat
from .drafter import add_drafter_parser, cmd_drafter_accuracy, cmd_train_drafter, cmd_warm_drafts
from ..bench.methods import OURS
from ..config import DEFAULT_LOOKUP_BRANCH, METHODS
from ..errors import ConfigError, SpeculantError
from ..store.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from ..runtime.process import tune_allocator


BENCH_METHODS = ("ar,auto,lookup,sd,llama-server,llama-server+draft,llama-server+ngram,llama-server+ngram-mod,"
                 "openvino,openvino+lookup,openvino+draft")
SESSION_ROWS = ("auto", "ar", "llama-server", "llama-server+ngram-mod")  # bench.sessions_run.DEFAULT_ROWS


def _decoder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model for sd/mcsd (directory, .gguf or preset)")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a peft LoRA adapter directory merged into the target's weights as it loads, before any "
                        "quantization: the adapted model is the one decoded (e.g. OUT/lora_adapter of "
                        "`train-heads --mode medusa2`; heads never bring it along)")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft length for sd and lookup (default: 4; lookup chosen by --method auto: up to 8, "
                        "sized per step)")
    p.add_argument("--tree", default=None,
                   help="mcsd/medusa/hydra tree: a k-config like 2x1x1x1 or 4x2x2x1, or a JSON list of paths; "
                        "medusa/hydra also dynamic[:N[:D]] (a tree of N nodes, depth <= D, grown at every step from "
                        "the heads' probabilities; N is the most, see --tree-budget). Default: 2x1x1x1 for mcsd; "
                        "medusa: dynamic, up to 32 rows sized per step (with --tree-budget fixed: the tree shipped "
                        "with the heads); hydra: dynamic, depth 2, up to 32 rows sized per step (with --tree-budget "
                        "fixed 15 nodes, or 15 - N with a lookup branch of N)")
    p.add_argument("--tree-file", default=None, help="medusa/hydra/mcsd: a JSON file with a list of paths")
    p.add_argument("--heads", default=None,
                   help="medusa/hydra/eagle/bpd: a heads directory (medusa/bpd: Medusa heads in the Medusa "
                        "checkpoint layout; hydra: sequential heads; eagle: an EAGLE drafter) (default: the heads "
                        "shipped for the target preset)")
    p.add_argument("--accept", default="exact",
                   help="acceptance rule: exact (lossless, default) or an approximate one that may change the "
                        "output: typical[=EPS[/DELTA]] (Medusa), topk[=K], dist=EPS (BPD), each optionally "
                        "+min=M (BPD minimum block)")
    p.add_argument("--no-replacement", action="store_true", help="mcsd: draw candidates without replacement")
    p.add_argument("--lookup-branch", type=int, default=0,
                   help="medusa/hydra: add a prompt-lookup (n-gram) chain of N tokens to the tree as one more "
                        "branch (default: 0, none; bench: the methods medusa+lookup / hydra+lookup use N, "
                        f"default {DEFAULT_LOOKUP_BRANCH})")
    p.add_argument("--tree-budget", choices=["auto", "fixed"], default="auto",
                   help="dynamic trees: auto (default) sizes every step's tree against this machine's measured "
                        "cost of a pass by rows (measured once, cached) for the most expected tokens per second; "
                        "fixed always verifies the tree's full size")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--draft-quant", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="weight-only quantization of the draft model; it cannot change the output, only the "
                        "speed (auto, the default: int4 for a bf16 draft on the native runtime, and on the "
                        "transformers one on AMX CPUs; else none)")
    p.add_argument("--backend", choices=["auto", "hf", "native"], default="auto",
                   help="model runtime: auto (default: speculant's own runtime (Llama, Mistral, Qwen2/3, Phi-3, "
                        "Gemma 2/3) where its kernels run, else transformers), hf (transformers) or native")
    p.add_argument("--target-quant", choices=["auto", "none", "int8", "int4", "gguf"], default="auto",
                   help="native backend: how the target's weights run. gguf: the GGUF file's own blocks (its Q4_K, "
                        "Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 layers as they are, int4 for other types): the "
                        "file's model; int4: every layer quantized again by speculant (smaller and faster, lossier); "
                        "none: bf16 weights; auto (default): gguf for a GGUF file or preset, int4 for a transformers "
                        "directory or with --lora. Measured on the default Q4_K_M file against llama.cpp's own "
                        "perplexity (docs/performance.md): gguf +0.09%% perplexity, KL 0.002; int4 with the output "
                        "layer +6.9%%, KL 0.057; none (the file's weights in bf16) +0.10%%; see `speculant quant-eval`")
    p.add_argument("--quant-head", action=argparse.BooleanOptionalAction, default=None,
                   help="with --target-quant: quantize the output layer too (default: yes with int4 and gguf)")
    p.add_argument("--no-pacing", action="store_true",
                   help="always draft (default: a step verifies the root alone while drafting does not pay)")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                   help="native runtime: the prefix cache's memory in MiB, KV entries of earlier prompts and "
                        "answers that a request starting the same way reuses instead of prefilling them "
                        "(default: a quarter of this machine's memory, at most 8192; 0: off)")


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
    g.add_argument("--method", choices=list(METHODS), default="auto",
                   help="auto (default): the fastest lossless method for this model and CPU (heads shipped for the "
                        "model: hydra+lookup; a --draft: sd; else lookup); the choice is printed")
    _sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output right before this text (repeat for up to 4)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this times as likely as the most likely one (0: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' (CTRL's), > 0 (1: off)")
    g.add_argument("--logit-bias", action="append", default=None, metavar="TOKEN=BIAS",
                   help="add BIAS (-100 to 100) to token id TOKEN's logit (repeat for more tokens)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability under the target and the K (0-20) most likely")
    g.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")

    c = sub.add_parser("chat", help="an interactive chat in the terminal (history kept, accepted draft tokens "
                                    "coloured, /help for its commands)")
    _decoder_args(c)
    c.add_argument("--method", choices=list(METHODS), default="auto",
                   help="as for generate (default: the fastest lossless method; it is printed)")
    _sampling_args(c)
    add_chat_options(c)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, streaming)")
    _decoder_args(sv)
    sv.add_argument("--method", choices=list(METHODS),
                    default="auto", help="as for generate (default: the fastest lossless method; it is printed)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1 requests (default: $SPECULANT_API_KEY if set)")
    sv.add_argument("--max-queue", type=int, default=16,
                    help="requests that may wait behind the running ones; more get HTTP 429 (default: %(default)s)")
    sv.add_argument("--max-batch", type=int, default=4,
                    help="requests decoded together, one target pass per step for all of them; new requests join "
                         "between steps, finished ones leave at once (continuous batching; 1: one at a time; "
                         "default: %(default)s)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413")
    sv.add_argument("--model-id", default=None, help="the model's id in the API (default: the target's name)")

    b = sub.add_parser("bench", help="compare methods side by side on Spec-Bench prompts")
    _decoder_args(b)
    b.add_argument("--methods", default=None,
                   help="comma-separated: " + ", ".join(OURS).replace("auto", "auto (what `generate` picks)") + " "
                        "(speculant's own; each optionally NAME:RULE with an approximate acceptance rule, e.g. "
                        "medusa:typical, bpd:topk=2+min=1), and peer rows: hf-assisted (transformers' assisted "
                        "generation); llama-server, llama-server+draft, llama-server+ngram, llama-server+ngram-mod, "
                        "llama-server+ngram-map-k (llama.cpp's server on the target's GGUF: plain, the draft's GGUF "
                        "as draft model, its n-gram lookups --spec-type ngram-simple, ngram-mod, ngram-map-k; needs "
                        "`make install-llama-server`); openvino, openvino+lookup, openvino+draft (OpenVINO GenAI on "
                        "the target's int4 IR: plain, prompt lookup, the draft's IR; needs `make install-openvino`, "
                        "and for a model other than the Qwen presets `tools/install_openvino.py --model SPEC`); a "
                        "peer that is not installed or cannot run the pair is skipped with a message. The rows "
                        "that draft (sd, mcsd, hf-assisted, the +draft peers) use --draft (default: the 0.5B "
                        "for the default target; no --draft for another target: skipped); a draft of another "
                        "vocabulary or larger than the target is an error before anything runs. One of ours may "
                        "end in @KEY=VALUE "
                        "options of its own row (heads=DIR, tree=SPEC|FILE.json, budget=auto|fixed, lookup=N, "
                        "gamma=N; @fixed = @budget=fixed), so two settings run side by side, e.g. "
                        f"hydra+lookup@heads=A,hydra+lookup@heads=B (default: {BENCH_METHODS}; with --sessions: "
                        f"{','.join(SESSION_ROWS)}, and the rows are servers: speculant's methods through `speculant "
                        "serve --method NAME` and the llama-server rows, each optionally @cache-ram=MB (both) or "
                        "@cache-reuse=N (llama-server))")
    b.add_argument("--sessions", default=None, metavar="FILE",
                   help="replay multi-turn sessions instead of single prompts: FILE is a JSONL file of sessions, or "
                        "'default' for the shipped one (chat, coding, agent and MT-bench sessions); every row is a "
                        "server started on loopback, one at a time, sent each turn with the whole history (streamed, "
                        "greedy, --max-new-tokens per turn): seconds per session, first-token time per turn, tok/s, "
                        "cached prompt tokens, and the ratio to the best llama-server row")
    b.add_argument("--sessions-kinds", default=None, metavar="KINDS",
                   help="with --sessions: only these kinds, comma-separated (chat, coding, agent, mt_bench)")
    b.add_argument("--limit", type=int, default=None, metavar="N",
                   help="with --sessions: only the first N sessions (after --sessions-kinds)")
    b.add_argument("--hydra-heads", default=None,
                   help="hydra: sequential heads directory (default: the ones shipped for the target preset)")
    b.add_argument("--per-category", type=int, default=1, help="prompts per Spec-Bench category")
    b.add_argument("--categories", default=None, help="comma-separated subset of categories")
    b.add_argument("--questions", default=None, help="a Spec-Bench-style JSONL file (default: the bundled one)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0: every row samples (prompt i with --seed + i), the peers are "
                        "skipped, and the mean target NLL of the sampled tokens replaces the output comparison")
    b.add_argument("--seed", type=int, default=0, help="with --temperature: the first prompt's seed")
    b.add_argument("--json-out", default=None, help="write runs and summary as JSON to this file")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw speed-up over ar per category and τ per method to this image (needs matplotlib)")

    r = sub.add_parser("bench-report", help="show a saved bench JSON: table, Markdown, plot, README section")
    r.add_argument("json", nargs="?", default=None,
                   help="a JSON written by `speculant bench --json-out` (default: the newest in benchmarks/)")
    r.add_argument("--plot", default=None, metavar="FILE.png", help="draw it to this image (needs matplotlib)")
    r.add_argument("--markdown", action="store_true", help="print the results table as Markdown")
    r.add_argument("--update-readme", default=None, metavar="README.md",
                   help="replace the text between <!-- results:begin --> and <!-- results:end --> in this file "
                        "with the Markdown results table")
    r.add_argument("--update-headline", default=None, metavar="README.md",
                   help="replace the text between <!-- headline:begin --> and <!-- headline:end --> in this file "
                        "with auto's speed over the best peer row of each --run (clean runs only)")
    r.add_argument("--run", action="append", default=[], metavar="LABEL=FILE.json",
                   help="with --update-headline: one clause, the CPU's label and its run (repeat, one per CPU)")

    sb = sub.add_parser("bench-serve", help="speculant serve against llama-server: time to first token and tokens/s, "
                                             "one streaming client, same prompts, same run")
    sb.add_argument("--rows", default=None,
                    help="comma-separated, of speculant (its default method), speculant-ar, "
                         "llama-server, llama-server+draft, llama-server+ngram (default: all)")
    sb.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category (default: 1)")
    sb.add_argument("--categories", default=None)
    sb.add_argument("--questions", default=None, help="a Spec-Bench-style JSONL file (default: the bundled one)")
    sb.add_argument("--max-new-tokens", type=int, default=128)
    sb.add_argument("--serve-args", default="", help="extra `speculant serve` options for the speculant rows, "
                                                     "one string (e.g. \"--target PRESET\")")
    sb.add_argument("--json-out", default=None, help="write the runs and summary as JSON to this file")
    sb.add_argument("--concurrency", default="1", help="comma-separated numbers of clients at once, e.g. 1,2,4: "
                                                      "servers decode that many requests together (speculant serve "
                                                      "--max-batch, llama-server -np); total and per-request tok/s "
                                                      "(default: %(default)s)")

    q = sub.add_parser("quant-eval", help="quality cost of target quantization: perplexity and greedy agreement")
    q.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    q.add_argument("--modes", default="none,int8,int4,int8+head,int4+head",
                   help="comma-separated quantizations; '+head' also quantizes the output layer; gguf: int4 with "
                        "the layers that are Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 in the GGUF file "
                        "running the file's own blocks; "
                        "llama.cpp: llama.cpp's own llama-perplexity on the same text (make install-llama-server), and "
                        "every mode also scored on its tokens against its distribution (default: %(default)s)")
    q.add_argument("--max-new-tokens", type=int, default=64, help="per agreement prompt (default: %(default)s)")
    q.add_argument("--json-out", default=None)

    d = sub.add_parser("demo", help="the default demo: the 1.5B target on a coding prompt, the default method's "
                                    "speed-up over plain decoding on the same runtime")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--methods", default="auto",
                   help="comma-separated: auto (the default method), lookup, sd, mcsd, medusa, medusa+lookup, hydra, "
                        "hydra+lookup (default: %(default)s)")

    add_training_parsers(sub)
    add_drafter_parser(sub)
    return parser


def _stdin_text() -> str:
    """The prompt piped in on standard input, which must be UTF-8 text."""
    from ..errors import ConfigError

    data = (sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer")
            else sys.stdin.read().encode("utf-8", "surrogateescape"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"the prompt on standard input is not UTF-8 text "
                          f"(byte {e.start}: {data[e.start:e.start + 4]!r}); "
                          "convert it first, e.g. `iconv -f latin1 -t utf-8 FILE | speculant generate -`") from None


def _tree(args):
    """--tree-file (a JSON list of paths) wins over --tree."""
    if not args.tree_file:
        return args.tree
    from ..errors import ConfigError

    try:
        with open(args.tree_file) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read --tree-file {args.tree_file}: {e.strerror}") from None


def _check_cache_ram(args) -> None:
    """``--cache-ram`` checked before any model loads."""
    if args.cache_ram is not None and args.cache_ram < 0:
        raise ConfigError(f"--cache-ram is the prefix cache's memory in MiB, >= 0 (0: no prefix cache), "
                          f"got {args.cache_ram}")


def _decoder(args):
    """The decoder the decoding options of ``generate`` / ``serve`` describe (the "auto" choices
    resolved for this machine); prints what runs and why."""
    from ..api import SpeculativeDecoder
    from ..config import parse_acceptance

    parse_acceptance(args.accept)
    _check_cache_ram(args)
    dec = SpeculativeDecoder(args.target, args.draft, method=args.method, gamma=args.gamma, tree=_tree(args),
                             replacement=not args.no_replacement, dtype=args.dtype, chat=args.chat,
                             draft_quant=args.draft_quant, heads=args.heads, acceptance=args.accept,
                             backend=args.backend, target_quant=args.target_quant, quant_head=args.quant_head,
                             lookup_branch=args.lookup_branch, tree_budget=args.tree_budget,
                             pacing=not args.no_pacing, lora=args.lora, cache_ram=args.cache_ram)
    if dec.why:
        print(f"speculant: {dec.why}", file=sys.stderr, flush=True)
    return dec


def cmd_generate(args) -> int:
    from ..config import SamplingConfig
    from ..errors import ConfigError
    from ..penalties import Penalties
    from ..stopping import parse_stop
    from ..text_check import check_text

    prompt = _stdin_text() if args.prompt == "-" else args.prompt
    # validate cheap arguments before loading any model
    penalties = Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty,
                          tuple(_logit_bias(args.logit_bias).items()))
    SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed, args.min_p, penalties)
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise ConfigError(f"--logprobs must be from 0 to 20, got {args.logprobs}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_text(prompt, "the prompt")
    if not prompt.strip():
        raise ConfigError("the prompt is empty: give some text to continue")
    parse_stop(args.stop)
    dec = _decoder(args)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
              min_p=args.min_p, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
              repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
              logprobs=args.logprobs)
    gen = dec.start(prompt, args.max_new_tokens, **kw)
    if args.json:
        try:
            result = gen.result()
        except KeyboardInterrupt:  # Ctrl-C: what was generated so far, then exit status 130
            print(json.dumps(_interrupted(dec, gen).to_dict()))
            return 130
        print(json.dumps(result.to_dict()))
        return 0
    from rich.console import Console

    console = Console(highlight=False)
    color = console.is_terminal
    try:
        for ev in gen:
            style = ("green" if ev.source == "draft" else "bold") if color else None
            console.print(ev.text, end="", style=style, markup=False, soft_wrap=True)
    except KeyboardInterrupt:  # the text so far is on the screen already
        done = _interrupted(dec, gen)
        console.print(done.text[len(gen.shown):], end="", markup=False, soft_wrap=True)  # held-back characters
        console.print()
        print(f"speculant: interrupted after {len(done.token_ids)} generated tokens", file=sys.stderr)
        return 130
    console.print()
    s = gen.stats.to_dict()
    console.print(f"[{s['target_calls']} target calls, {s['tokens_per_call']:.2f} tokens/call, "
                  f"α={s['acceptance_rate']:.2f}, {s['tokens_per_s']:.2f} tokens/s"
                  + ("" if s["lossless"]
                     else f"; APPROXIMATE acceptance {s['acceptance']}: output may differ from the target's")
                  + (f"; {s['plain_steps']} of {s['target_calls']} steps without drafting (it did not pay there)"
                     if s["plain_steps"] else "")
                  + ("; green = accepted draft tokens" if color and dec.config.spec.drafts else "") + "]",
                  style="dim", markup=False)
    return 0


def _logit_bias(pairs: list[str] | None) -> dict[int, float]:
    """``--logit-bias TOKEN=BIAS`` arguments as {token id: bias}."""
    from ..errors import ConfigError

    out = {}
    for pair in pairs or []:
        tok, sep, bias = pair.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias {pair!r}: use TOKEN=BIAS with an integer token id and a number, "
                              "e.g. --logit-bias 42=-100") from None
        if not sep:
            raise ConfigError(f"--logit-bias {pair!r}: use TOKEN=BIAS, e.g. --logit-bias 42=-100")
    return out


def _interrupted(dec, gen):
    """The result of a generation stopped by Ctrl-C: its tokens so far, ``finish_reason`` "cancelled"."""
    from ..api import GenerationResult
    from ..decoding import Stats

    text = dec.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    return GenerationResult(text, list(gen.token_ids), gen.prompt_tokens, "cancelled", gen.stats or Stats())


def cmd_serve(args) -> int:
    import os

    from ..errors import ConfigError

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 1 or args.max_body_bytes < 1024 or args.max_batch < 1:
        raise ConfigError("--max-queue and --max-batch must be >= 1 and --max-body-bytes >= 1024")
    api_key = args.api_key or os.environ.get("SPECULANT_API_KEY") or None
    from ..serve.app import ServeConfig
    from ..serve.server import serve

    args.chat = False  # /v1/chat/completions applies the chat template; /v1/completions sends raw text
    serve(_decoder(args), ServeConfig(host=args.host, port=args.port, api_key=api_key, max_queue=args.max_queue,
                                      max_batch=args.max_batch, max_body_bytes=args.max_body_bytes,
                                      model_id=args.model_id))
    return 0


def cmd_bench(args, argv: list[str] | None = None) -> int:
    from ..bench.harness import BenchConfig, command_line, run_bench

    _check_cache_ram(args)
    if args.sessions is not None:
        return _bench_sessions(args, argv)
    if args.sessions_kinds is not None or args.limit is not None:
        raise ConfigError("--sessions-kinds and --limit go with --sessions FILE (or --sessions default)")
    # the default target's sibling drafts unless --draft names another; any other target drafts only with a --draft
    draft = args.draft or (DEFAULT_DRAFT if args.target == DEFAULT_TARGET else None)
    cfg = BenchConfig(target=args.target, draft=draft, auto_draft=args.draft is not None,
                      methods=tuple((args.methods or BENCH_METHODS).split(",")),
                      per_category=args.per_category, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                      lookup_branch=args.lookup_branch or DEFAULT_LOOKUP_BRANCH,
                      tree=args.tree, medusa_tree=_tree(args) if args.tree_file else None, heads=args.heads,
                      hydra_heads=args.hydra_heads, replacement=not args.no_replacement, dtype=args.dtype,
                      draft_quant=args.draft_quant, backend=args.backend, target_quant=args.target_quant,
                      quant_head=args.quant_head, tree_budget=args.tree_budget, pacing=not args.no_pacing,
                      lora=args.lora, cache_ram=0 if args.cache_ram is None else args.cache_ram,
                      categories=tuple(args.categories.split(",")) if args.categories else None,
                      questions=args.questions, json_out=args.json_out, temperature=args.temperature,
                      seed=args.seed)
    if args.plot:
        from ..bench.plot import check_plot_path

        check_plot_path(args.plot)  # before the run, not after it
    result = run_bench(cfg, command=command_line(argv))
    if args.plot:
        from ..bench.plot import plot_result

        print(f"plot: {plot_result(result, args.plot)}")
    return 0


def _bench_sessions(args, argv: list[str] | None) -> int:
    """``bench --sessions``: the bench's decoding options that differ from their defaults go to
    ``speculant serve``; the options of single-prompt runs are refused."""
    from ..bench.harness import command_line
    from ..bench.sessions_report import print_tables
    from ..bench.sessions_run import SessionsBenchConfig, run_sessions_bench

    for flag, value, default in (("--questions", args.questions, None), ("--categories", args.categories, None),
                                 ("--plot", args.plot, None), ("--temperature", args.temperature, 0.0),
                                 ("--per-category", args.per_category, 1), ("--hydra-heads", args.hydra_heads, None)):
        if value != default:
            raise ConfigError(f"{flag} does not apply to --sessions (sessions are replayed greedy, turn by turn); "
                              f"drop it, or run bench without --sessions")
    draft = args.draft or (DEFAULT_DRAFT if args.target == DEFAULT_TARGET else None)
    rows = tuple(r for r in args.methods.split(",") if r.strip()) if args.methods else None
    cfg = SessionsBenchConfig(sessions=args.sessions, **({"rows": rows} if rows is not None else {}),
                              max_new_tokens=args.max_new_tokens,
                              kinds=(tuple(k for k in args.sessions_kinds.split(",") if k)
                                     if args.sessions_kinds else None),
                              limit=args.limit, target=args.target, draft=draft,
                              serve_args=_changed_decoder_args(args, skip=("target", "draft")), json_out=args.json_out)
    result = run_sessions_bench(cfg, command=command_line(argv))
    print_tables(result)
    return 1 if result["failed"] or result["summary"]["left_out"] else 0


def _changed_decoder_args(args, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The decoding options (``_decoder_args``) of ``args`` that differ from their defaults, as the
    command-line options that give them (for ``speculant serve``)."""
    p = argparse.ArgumentParser(add_help=False)
    _decoder_args(p)
    out: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in skip or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true
            out.append(flag)
        else:
            out += [flag, str(value)]
    return tuple(out)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    from ..errors import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, e.g. 1,2,4; got {text!r}") from None


def cmd_bench_serve(args, argv: list[str] | None = None) -> int:
    import shlex

    from ..bench.harness import command_line
    from ..bench.serve_bench import ServeBenchConfig, format_table, run_serve_bench
    from ..errors import ConfigError

    rows = {"rows": tuple(r for r in args.rows.split(",") if r)} if args.rows is not None else {}
    try:
        serve_args = tuple(shlex.split(args.serve_args))
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"cannot split --serve-args {args.serve_args!r} into options ({e}): quote it as a shell "
                          "would, e.g. --serve-args \"--target PRESET\"") from None
    cfg = ServeBenchConfig(**rows, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
                           categories=tuple(args.categories.split(",")) if args.categories else None,
                           questions=args.questions, serve_args=serve_args,
                           json_out=args.json_out, concurrency=_int_list(args.concurrency, "--concurrency"))
    result = run_serve_bench(cfg, command=command_line(argv))
    print(format_table(result))
    return 0


def cmd_bench_report(args) -> int:
    from pathlib import Path

    from ..bench.report import load_result, markdown_table, newest_result, print_summary, update_readme

    if args.update_headline:
        from ..bench.headline import update_headline

        if args.json or args.plot or args.markdown or args.update_readme:
            raise ConfigError("--update-headline takes its runs from --run LABEL=FILE.json; give the table's "
                              "options in another call")
        update_headline(args.update_headline, args.run)
        print(f"{args.update_headline}: headline from {len(args.run)} run(s)", file=sys.stderr)
        return 0
    if args.run:
        raise ConfigError("--run goes with --update-headline README.md")
    path = Path(args.json) if args.json else newest_result()
    result = load_result(path)
    if args.plot:
        from ..bench.plot import check_plot_path, plot_result

        check_plot_path(args.plot)
        print(f"plot: {plot_result(result, args.plot)}", file=sys.stderr)
    if args.markdown:
        print(markdown_table(result, path.as_posix()), end="")
    if args.update_readme:
        update_readme(args.update_readme, result, path)
        print(f"{args.update_readme}: results table from {path}", file=sys.stderr)
    if not (args.plot or args.markdown or args.update_readme):
        from ..bench.report import caption, full_summary

        print_summary(full_summary(result), caption(result, path.as_posix(), markdown=False))
    return 0


def cmd_quant_eval(args) -> int:
    from ..bench.quality import run_quality

    run_quality(args.target, tuple(args.modes.split(",")), args.max_new_tokens, args.json_out)
    return 0


def cmd_demo(args) -> int:
    from ..bench.demo import run_demo

    run_demo(args.max_new_tokens, args.methods)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                    "bench": lambda a: cmd_bench(a, argv),
                    "bench-report": cmd_bench_report, "bench-serve": lambda a: cmd_bench_serve(a, argv),
                    "demo": cmd_demo,
                    "train-heads": cmd_train_heads, "quant-eval": cmd_quant_eval, "build-tree": cmd_build_tree,
                    "export-heads": cmd_export_heads, "make-corpus": cmd_make_corpus,
                    "make-conversations": cmd_make_conversations, "train-drafter": cmd_train_drafter,
                    "drafter-accuracy": cmd_drafter_accuracy, "warm-drafts": cmd_warm_drafts,
                    "train-eagle": cmd_train_eagle, "export-eagle": cmd_export_eagle,
                    "cut-vocab": cmd_cut_vocab}
        return commands[args.command](args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or directory the command could not read or write
        where = f": {e.filename}" if e.filename else ""
        print(f"speculant: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
