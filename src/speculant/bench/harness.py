"""Spec-Bench-style harness: every method on the same prompts, interleaved per prompt, in one
process, so speed-ups are ratios measured side by side (these machines are noisy).

A row is a method spec (``bench.methods``): ``NAME[:RULE][@KEY=VALUE]...``, e.g. ``medusa:typical``,
``bpd:topk=2+min=1``, ``hydra+lookup@fixed`` beside ``hydra+lookup`` (the fixed 16-row tree against
the sized one), ``hydra+lookup@heads=DIR`` (other heads), ``medusa+lookup@tree=dynamic:23:4``.
Quality is scored next to speed where Spec-Bench has references (``bench.report``).

Peer rows (``PEERS``): other runtimes, fed the same prompt token ids, each at its own best
configuration of its kind:

- ``hf-assisted``: transformers' ``generate(assistant_model=...)`` on the same two models;
- ``llama-server``, ``llama-server+draft``, ``llama-server+ngram``, ``+ngram-mod``, ``+ngram-map-k``:
  llama.cpp's server on the target's GGUF: plain, the draft's GGUF as draft model (3 tokens), its
  n-gram lookups (``bench.llama_server``; needs ``make install-llama-server``);
- ``openvino``, ``openvino+lookup``, ``openvino+draft``: OpenVINO GenAI on the int4 IR of the
  target: plain, prompt lookup (3 tokens), the draft's IR (3 tokens) (``bench.openvino``; needs
  ``make install-openvino``, which exports the Qwen presets; another model once with
  ``tools/install_openvino.py --model SPEC``).

Any pair runs (``--target X --draft Y``): the peers get the same GGUF files or the IR exported from
them (``bench.pair.plan_peers``). Before any model loads, a spec that names nothing, and for the
rows that draft (``bench.pair.DRAFT_ROWS``) a draft of another vocabulary or larger than the
target, is a one-line error (``bench.pair``). A peer whose runtime is not installed, or that cannot
run this pair (a transformers directory has no GGUF for llama-server; no IR was exported; no
``--draft``), is skipped with a message and the rest of the bench runs. Peers are started once
per bench (only those asked for), warmed up like every row (one short generation), and stopped at
the end, also on an error or Ctrl-C.
The summary's keys and the tables' columns are described in ``bench.report``.

EOS: runtimes differ in whether their output lists the end-of-sequence token they stopped at.
Every row's output is cut at its first EOS id (the target's generation-config EOS ids, in the
JSON as ``eos_token_ids``), the EOS itself dropped: a run's ``token_ids`` and ``new_tokens`` never
include it (``eos`` says whether the row stopped at one), for every row alike, and outputs are
compared in that form. tokens/s therefore counts the tokens of the answer, not the stop token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..api import BACKENDS, TREE_BUDGETS, SpeculativeDecoder, auto_draft_quant, load_native
from ..config import DEFAULT_LOOKUP_BRANCH, SamplingConfig
from ..defaults import choose_runtime
from ..eagle.checkpoint import is_eagle_dir
from ..errors import ConfigError
from ..store.loading import load_adapted
from ..specbench import load_questions
from ..provenance import (CAPPING_ENV, CPU_FLAGS, command_line, git_info, machine_info,  # noqa: F401 (re-exported)
                          provenance, provenance_warning)
from ..store.lora import check_adapter_dir
from ..store.chat import chat_prompt
from ..store.models import check_vocab_compatible, load
from ..output_paths import check_output_file
from .llama_server import LlamaServer, llama_server_unavailable
from .methods import (LLAMA_SERVER, OPENVINO, OURS, PEERS, is_peer, parse_method, plain_of,  # noqa: F401 (re-exported)
                      read_tree, response_format_of, split_method, tree_budget_of)
from .openvino import OpenVINOPeer, openvino_unavailable
from .pair import check_pair, check_spec, no_draft, plan_peers, uses_draft
from .quality import sampled_nll
from .report import (CATEGORY_ORDER, cut_at_eos, final_number, print_summary, quality_scores,  # noqa: F401 (re-exported)
                     summarize)




@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str | None = None  # None: the rows that draft (bench.pair.DRAFT_ROWS) are skipped
    auto_draft: bool = False  # the auto row may draft with ``draft`` (as generate --draft does): given by the user
    methods: tuple[str, ...] = ("ar", "sd", "mcsd", "lookup", "hf-assisted")
    per_category: int = 1
    max_new_tokens: int = 128
    gamma: int | None = None  # sd / lookup draft length (None: the decoder's default)
    lookup_branch: int = DEFAULT_LOOKUP_BRANCH  # medusa+lookup / hydra+lookup: the prompt-lookup chain's length
    tree: str | None = None  # mcsd: 2x1x1x1; medusa: the heads' tree
    medusa_tree: str | None = None  # medusa's tree when both run (default: the tree shipped with the heads)
    heads: str | None = None  # medusa/bpd heads directory (default: shipped for the target preset)
    hydra_heads: str | None = None  # hydra's sequential heads directory (default: shipped for the target preset)
    replacement: bool = True
    dtype: str = "bfloat16"
    draft_quant: str = "auto"
    backend: str = "auto"  # auto: the native int4 runtime where it runs (speculant.defaults)
    target_quant: str = "auto"
    quant_head: bool | None = None
    tree_budget: str = "auto"  # dynamic trees: sized against the machine's pass cost, or "fixed"
    pacing: bool = True  # drafting paused while it does not pay (drafters.pacing)
    categories: tuple[str, ...] | None = None
    questions: str | None = None
    json_out: str | None = None
    temperature: float = 0.0  # > 0: every row samples (prompt i with seed seed + i); the peers run greedy only
    seed: int = 0
    lora: str | None = None  # a LoRA adapter merged into the target (speculant.store.lora); the peers are skipped
    # our rows' prefix cache in MiB (DecoderConfig.cache_ram; None: its default). Off by default: the
    # bench times single fresh requests with the peers' caches off, and the warm-up's prompt is the
    # first timed one, so a cache would halve that row's prefill
    cache_ram: int | None = 0

    def __post_init__(self):
        for m in self.methods:
            parse_method(m)  # a ConfigError names the bad part and the valid keys
        if self.tree_budget not in TREE_BUDGETS:
            raise ConfigError(f"unknown --tree-budget {self.tree_budget!r}: choose {' or '.join(TREE_BUDGETS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"--methods lists a method twice: {','.join(self.methods)}")
        if "ar" not in self.methods:
            raise ConfigError("bench needs the 'ar' baseline in --methods: speed-ups are measured against it")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.target_quant not in ("auto", "none") and self.backend == "hf":
            raise ConfigError("--target-quant needs --backend native (or auto)")
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise ConfigError("--per-category and --max-new-tokens must be >= 1")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        SamplingConfig(self.temperature, seed=self.seed)  # a temperature or seed no row can sample with
        if self.lookup_branch < 1:
            raise ConfigError(f"--lookup-branch must be >= 1 for the +lookup methods, got {self.lookup_branch}")
        if self.lora is not None:
            check_adapter_dir(self.lora)
        if self.questions is not None:
            load_questions(self.questions)  # a file that cannot be read fails here, not after the models load
        if self.json_out:
            check_output_file(self.json_out, "--json-out")  # before the run, not after it


def select(rows: list[dict], per_category: int, categories: tuple[str, ...] | None) -> list[dict]:
    cats = categories or CATEGORY_ORDER
    out = []
    for c in cats:
        picked = [r for r in rows if r["group"] == c][:per_category]
        if not picked:
            raise ConfigError(f"no questions in category {c!r}; categories: {', '.join(CATEGORY_ORDER)}")
        out += picked
    return out


class _FirstBlock:
    """A ``generate`` streamer that notes when the first generated tokens arrive (its first
    ``put`` is the prompt)."""

    def __init__(self):
        self.puts, self.t = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.t = time.perf_counter()

    def end(self) -> None:
        pass


class HFAssisted:
    """The peer: transformers' own ``generate(assistant_model=...)`` on the same two models."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float, dict]:
        """(new token ids, wall seconds, {"prefill_s": time to the first streamed block})."""
        first = _FirstBlock()
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(
                ids.view(1, -1), attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                assistant_model=self.draft.model, do_sample=False, max_new_tokens=max_new_tokens,
                pad_token_id=self.target.tokenizer.eos_token_id, streamer=first)
        wall = time.perf_counter() - t
        return out[0, ids.shape[0]:].tolist(), wall, {"prefill_s": (first.t - t) if first.t is not None else 0.0}


OPENVINO_SPEC_TOKENS = 3  # openvino+lookup / openvino+draft: candidate tokens per step
OPENVINO_NGRAM = 3  # openvino+lookup: longest n-gram matched


def _peer_unavailable(m: str, cfg: BenchConfig) -> str | None:
    """Why peer row ``m`` cannot run here (its runtime is not installed, or it cannot run this
    target), or None (also for speculant's own methods)."""
    if cfg.lora is not None and is_peer(m):
        return "the peers run the target's original weights; with --lora only speculant's rows decode the adapted model"
    if cfg.temperature > 0 and is_peer(m):
        return ("the bench runs the peers greedy only; at --temperature > 0 it compares speculant's rows "
                "with each other (run the peers without --temperature)")
    if m in LLAMA_SERVER:
        return llama_server_unavailable()
    if m in OPENVINO:  # the venv, and the IR exported for this target (and draft)
        return openvino_unavailable(draft=m == "openvino+draft", target=cfg.target, draft_model=cfg.draft)
    return None


def _llama_server_version(binary: Path) -> str | None:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(binary.parent) + (os.pathsep + env["LD_LIBRARY_PATH"]
                                                   if env.get("LD_LIBRARY_PATH") else "")
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, env=env,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x.strip() for x in (r.stdout + "\n" + r.stderr).splitlines()
             if x.strip().startswith(("version:", "built with"))]
    return "; ".join(lines) or None


def _export_info(ir: Path) -> dict | None:
    try:
        return json.loads((ir / "speculant_export.json").read_text())
    except (OSError, ValueError):
        return None


def peer_details(m: str, runner, cfg: BenchConfig) -> dict:
    """What ran behind peer row ``m``: runtime, version, command line or settings, models."""
    if isinstance(runner, LlamaServer):
        from .llama_server import LLAMA_CPP_VERSION

        return {"runtime": "llama-server", "config": runner.config, "binary": str(runner.binary),
                "version": _llama_server_version(runner.binary), "llama_cpp_python_sdist": LLAMA_CPP_VERSION,
                "target_gguf": str(runner.target), "draft_gguf": str(runner.draft) if runner.draft else None,
                "threads": runner.n_threads, "n_ctx": runner.n_ctx, "args": runner.args(runner.port or 0)[1:]}
    if isinstance(runner, OpenVINOPeer):
        d = {"runtime": "openvino-genai", "config": runner.config, "exact": runner.exact, "threads": runner.threads,
             "target_ir": str(runner.target), "target_export": _export_info(runner.target),
             "worker": runner.info}  # versions, precision properties in effect, the CPU plugin's defaults, eos
        if runner.config == "draft":
            d.update(draft_ir=str(runner.draft), draft_export=_export_info(runner.draft),
                     num_assistant_tokens=OPENVINO_SPEC_TOKENS)
        elif runner.config == "lookup":
            d.update(num_assistant_tokens=OPENVINO_SPEC_TOKENS, max_ngram_size=OPENVINO_NGRAM)
        return d
    if isinstance(runner, HFAssisted):
        import transformers

        return {"runtime": "transformers", "version": transformers.__version__, "target": cfg.target,
                "assistant": cfg.draft, "dtype": cfg.dtype}
    details = getattr(runner, "details", None)
    return details() if callable(details) else {"runtime": type(runner).__name__}


def run_bench(cfg: BenchConfig, command: str | None = None) -> dict:
    """Run the bench, print its tables, write ``cfg.json_out``; return the result (see the module
    docstring). ``command``: the command line that ran it, recorded in the JSON."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    methods = list(cfg.methods)
    skipped: dict[str, str] = {}

    def skip(m: str, why: str) -> None:
        console.print(f"[yellow]skipping the {m} row: {escape(why)}[/yellow]")
        skipped[m] = why
        methods.remove(m)

    # the pair, before any model loads: a spec that names nothing, and for the rows that draft a
    # draft of another vocabulary or larger than the target, is a one-line error
    check_spec(cfg.target, "--target")
    if cfg.draft is not None:
        check_spec(cfg.draft, "--draft")
    for m in list(methods):
        if uses_draft(m) and cfg.draft is None:
            skip(m, no_draft(cfg.target))
        elif why := _peer_unavailable(m, cfg):
            skip(m, why)
    if any(uses_draft(m) for m in methods) or (cfg.auto_draft and cfg.draft is not None and "auto" in methods):
        check_pair(cfg.target, cfg.draft)
    files = plan_peers([m for m in methods if is_peer(m)], cfg.target, cfg.draft)
    for m, planned in files.items():
        if planned.skip:
            skip(m, planned.skip)
    peers: dict[str, object] = {}  # every peer started here is closed at the end, whatever happens
    try:
        for m in list(methods):  # llama-server: checked here, started at its warm-up
            if m in LLAMA_SERVER:
                try:
                    peers[m] = LlamaServer(LLAMA_SERVER[m], target=files[m].target, draft=files[m].draft)
                except ConfigError as e:
                    skip(m, str(e))
        return _run(cfg, methods, peers, files, skipped, console, date, command, git_info())
    finally:
        for p in peers.values():
            try:
                p.close()
            except Exception as e:  # noqa: BLE001 - close the others all the same
                console.print(f"[red]closing a peer failed: {type(e).__name__}: {e}[/red]")


def _run(cfg: BenchConfig, methods: list[str], peers: dict, files: dict, skipped: dict, console, date: str,
         command: str | None, cfg_source: dict) -> dict:
    """The bench's run proper; ``files``: :func:`plan_peers`'s; ``cfg_source``: :func:`git_info`
    when the run started."""
    from rich.console import Console

    needs_draft = any(split_method(m)[0] in ("sd", "mcsd", "hf-assisted") or (m == "auto" and cfg.auto_draft)
                      for m in methods)  # speculant loads it
    rt = choose_runtime(cfg.target, cfg.dtype, cfg.backend, cfg.target_quant, cfg.quant_head,
                        adapted=cfg.lora is not None)
    cfg = dataclasses.replace(cfg, backend=rt.backend, target_quant=rt.target_quant, quant_head=rt.quant_head)
    console.print(f"speculant bench: {rt.why}")
    # hf-assisted runs transformers models; the native backend shares their weights then. Without
    # it, the native backend loads lean (quantized layers read and quantized one at a time).
    lean = cfg.backend == "native" and "hf-assisted" not in methods and cfg.lora is None
    if lean:
        target = load_native(cfg.target, cfg.dtype, cfg.target_quant, cfg.quant_head)
        draft = load_native(cfg.draft, cfg.dtype, _draft_quant(cfg)) if needs_draft else None
    else:  # with --lora: the adapter merged into the transformers model, which the native runtime then reads
        target = load_adapted(cfg.target, cfg.dtype, cfg.lora) if cfg.lora is not None else load(cfg.target, cfg.dtype)
        draft = load(cfg.draft, cfg.dtype) if needs_draft else None
    if draft is not None:
        check_vocab_compatible(target, draft)
    runners = {}
    ours_draft = None  # one (quantized) draft shared by sd and mcsd; hf-assisted gets the original
    # per target quantization (--target-quant's, and each @quant=Q of a row), the native target every
    # row of ours on it shares
    ours_target = {}
    resolved = {}  # auto: the method it chose
    for m in methods:
        spec = parse_method(m)
        if spec.name in PEERS:
            continue
        drafts = spec.name in ("sd", "mcsd") or (spec.name == "auto" and cfg.auto_draft and draft is not None)
        quant = spec.options.get("quant", cfg.target_quant)
        if quant not in ours_target and quant != cfg.target_quant:
            if cfg.backend != "native" or cfg.lora is not None:
                raise ConfigError(f"{m}: @quant runs on the native runtime without --lora")
            ours_target[quant] = load_native(cfg.target, cfg.dtype, quant, cfg.quant_head and quant != "none")
        dec = SpeculativeDecoder(ours_target.get(quant, target), (ours_draft or draft) if drafts else None,
                                 method=spec.base, replacement=cfg.replacement, acceptance=spec.rule,
                                 draft_quant="none" if (ours_draft or lean) else cfg.draft_quant,
                                 backend=cfg.backend, target_quant=quant,
                                 quant_head=cfg.quant_head and quant != "none",
                                 pacing=cfg.pacing, cache_ram=cfg.cache_ram, **_row_settings(spec, cfg))
        ours_draft = ours_draft or dec.draft
        ours_target.setdefault(quant, dec.target)
        runners[m] = dec
        if spec.name == "auto":
            resolved[m] = {"method": f"{dec.method}{'+lookup' if dec.lookup_branch else ''}", "why": dec.why}
            console.print(f"speculant bench: auto = {resolved[m]['method']}: {dec.why}")
    tok = target.tokenizer
    eos_ids = set(runners["ar"].eos_token_ids) | ({tok.eos_token_id} - {None})
    for m in methods:  # the peers, in the order asked for
        if m == "hf-assisted":
            runners[m] = HFAssisted(target, draft)
        elif m in OPENVINO:  # the worker loads the model now; the warm-up compiles it
            peers[m] = OpenVINOPeer(OPENVINO[m], eos_token_ids=eos_ids, num_assistant_tokens=OPENVINO_SPEC_TOKENS,
                                    max_ngram_size=OPENVINO_NGRAM, target=files[m].target, draft=files[m].draft)
        if m in peers:
            runners[m] = peers[m]
    questions = select(load_questions(cfg.questions), cfg.per_category, cfg.categories)
    encoded = [tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0]
               for q in questions]
    # warm-up: one short generation per method (first calls pay one-off allocation costs; a
    # llama-server starts, an OpenVINO pipeline compiles)
    formats = {m: response_format_of(m) for m in methods if not is_peer(m)}  # @format=: constrained rows
    for m in methods:
        _run_one(runners[m], encoded[0], 8, response_format=formats.get(m))
    details = {m: peer_details(m, runners[m], cfg) for m in methods if is_peer(m)}
    scorer = runners["ar"].target_backend.sibling() if cfg.temperature > 0 else None  # target_nll's passes
    runs = []
    for qi, (q, ids) in enumerate(zip(questions, encoded)):
        order = list(methods) if qi % 2 == 0 else list(reversed(methods))  # interleave
        for m in order:
            raw, wall, prefill, stats, timing = _run_one(runners[m], ids, cfg.max_new_tokens, cfg.temperature,
                                                         cfg.seed + qi, formats.get(m))
            tokens, eos = cut_at_eos(raw, eos_ids)
            n = len(tokens)
            row = {"method": m, "question_id": q["question_id"], "category": q["group"],
                   "new_tokens": n, "eos": eos, "wall_s": wall, "prefill_s": prefill,
                   "tokens_per_s": n / wall, "decode_tokens_per_s": n / (wall - prefill) if wall > prefill else 0.0,
                   "token_ids": tokens, "text": tok.decode(tokens, skip_special_tokens=True)}
            if q.get("reference"):
                row["reference"] = q["reference"][0]
            if cfg.temperature > 0:
                row["target_nll"] = sampled_nll(scorer, ids, tokens, cfg.temperature)
            if stats is not None:
                row["stats"] = stats
            if timing is not None:
                row["timing"] = timing
            runs.append(row)
            console.print(f"[dim]{q['group']:>14} q{q['question_id']:<4} {m:>18}: {n:4d} tokens "
                          f"{wall:7.2f} s {row['tokens_per_s']:6.2f} tok/s, "
                          f"decode {row['decode_tokens_per_s']:6.2f} tok/s[/dim]", soft_wrap=True)
    summary = summarize(runs, methods, eos_ids, sampled=cfg.temperature > 0)
    quant = f", target {cfg.target_quant}" if cfg.target_quant != "none" else ""
    quant += f", LoRA {cfg.lora} merged" if cfg.lora is not None else ""
    decoding = "greedy" if cfg.temperature == 0 else f"temperature {cfg.temperature:g} (seed {cfg.seed} + prompt)"
    drafted = f" (draft {cfg.draft})" if cfg.draft is not None else ""
    print_summary(summary, f"speculant bench: {cfg.target}{drafted}, {cfg.dtype}, {cfg.backend} backend"
                           f"{quant}, {decoding}, {len(questions)} prompts x {cfg.max_new_tokens} new tokens")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    others = " (the peers' own processes not included)" if peers else ""
    Console().print(f"peak RSS of this process (every model of the run loaded): {peak_gb:.2f} GB{others}")
    best = next(iter(summary.values()), {})
    source = provenance(cfg_source, git_info())
    if (why := provenance_warning(source)) is not None:
        Console(stderr=True).print(f"[yellow]speculant bench: {why}[/yellow]")
    result = {"config": dict(cfg.__dict__), "command": command, "date": date,
              "machine": machine_info(), **source, "eos_token_ids": sorted(eos_ids), "skipped": skipped,
              "peers": details,
              "best_peer": {"tokens_per_s": best.get("best_peer"), "decode_tokens_per_s": best.get("best_peer_decode")},
              "resolved": resolved, "runs": runs, "summary": summary, "peak_rss_gb": peak_gb}
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=1))
    return result


def _row_settings(spec, cfg: BenchConfig) -> dict:
    """The decoder settings of one of our rows: its own ``@KEY=VALUE`` options over the bench-wide ones."""
    o = spec.options
    if "tree" in o:
        tree = read_tree(o["tree"])
    else:
        tree = cfg.medusa_tree if spec.base == "medusa" else cfg.tree if spec.name == "mcsd" else None
    if o.get("heads"):
        heads = o["heads"]
    elif spec.base == "hydra":
        heads = cfg.hydra_heads
    elif spec.base != "eagle" and cfg.heads is not None and is_eagle_dir(cfg.heads):
        heads = None  # an EAGLE drafter (--heads) is for the eagle rows; auto and medusa keep their own
    else:
        heads = cfg.heads
    gamma = spec.int_option("gamma") or cfg.gamma
    lookup = (spec.int_option("lookup") or cfg.lookup_branch) if spec.lookup else 0
    return {"tree": tree, "heads": heads, "gamma": gamma, "lookup_branch": lookup,
            "tree_budget": o.get("budget", cfg.tree_budget)}


def _draft_quant(cfg: BenchConfig) -> str:
    return auto_draft_quant(cfg.dtype, "native") if cfg.draft_quant == "auto" else cfg.draft_quant


def _run_one(runner, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             response_format: dict | None = None):
    """(token ids as the runner gave them, wall s, prefill s, our decoder's stats or None, a peer's
    timing or None). Peers' ``run`` returns (token ids, wall s, timing with ``prefill_s``); they
    run greedy (the bench skips them at a temperature). ``response_format``: our rows' ``@format=``
    (the grammar compiled at the warm-up, as a server's cache holds it)."""
    if isinstance(runner, SpeculativeDecoder):
        t = time.perf_counter()
        res = runner.generate(ids, max_new_tokens, temperature=temperature, seed=seed,
                              response_format=response_format)
        wall = time.perf_counter() - t
        stats = res.stats.to_dict()
        return res.token_ids, wall, min(float(stats.get("prefill_s", 0.0)), wall), stats, None
    tokens, wall, timing = runner.run(ids, max_new_tokens)
    return tokens, wall, min(float(timing.get("prefill_s") or 0.0), wall), None, dict(timing)
