"""Spec-Bench-style harness: every method on the same prompts, interleaved per prompt, in one
process, so speed-ups are ratios measured side by side (these machines are noisy).

speedup(method) = tokens/s of the method / tokens/s of ``ar``, over the same prompts and run.

A method is ``NAME`` or ``NAME:RULE`` with an approximate acceptance rule (``config.parse_acceptance``),
e.g. ``medusa:typical``, ``bpd:topk=2``, ``bpd:topk=2+min=1``, ``bpd:dist=0.5``; a dynamic-tree method
may end in ``@fixed`` or ``@auto`` to set its tree budget against ``--tree-budget`` (e.g.
``hydra+lookup@fixed`` beside ``hydra+lookup`` compares the fixed 16-row tree with the sized one). Quality is scored
next to speed where Spec-Bench has references: corpus BLEU (sacrebleu) on ``translation`` and
exact match of the final number on ``math_reasoning`` (GSM8K's ``#### N``).
"""

from __future__ import annotations

import json
import re
import resource
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..api import BACKENDS, TREE_BUDGETS, SpeculativeDecoder, auto_draft_quant, load_native
from ..config import DEFAULT_LOOKUP_BRANCH, parse_acceptance
from ..errors import ConfigError
from ..models import chat_prompt, check_vocab_compatible, load
from .llamacpp import LlamaCppPlain, llamacpp_unavailable

OURS = ("ar", "sd", "mcsd", "lookup", "medusa", "medusa+lookup", "hydra", "hydra+lookup", "bpd")
PEERS = ("hf-assisted", "llamacpp")
CATEGORY_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    methods: tuple[str, ...] = ("ar", "sd", "mcsd", "lookup", "hf-assisted")
    per_category: int = 1
    max_new_tokens: int = 128
    gamma: int = 4
    lookup_branch: int = DEFAULT_LOOKUP_BRANCH  # medusa+lookup / hydra+lookup: the prompt-lookup chain's length
    tree: str | None = None  # mcsd: 2x1x1x1; medusa: the heads' tree
    medusa_tree: str | None = None  # medusa's tree when both run (default: the tree shipped with the heads)
    heads: str | None = None  # medusa/bpd heads directory (default: shipped for the target preset)
    hydra_heads: str | None = None  # hydra's sequential heads directory (default: shipped for the target preset)
    replacement: bool = True
    dtype: str = "bfloat16"
    draft_quant: str = "auto"
    backend: str = "hf"
    target_quant: str = "none"
    quant_head: bool = False
    tree_budget: str = "auto"  # dynamic trees: sized against the machine's pass cost, or "fixed"
    categories: tuple[str, ...] | None = None
    questions: str | None = None
    json_out: str | None = None

    def __post_init__(self):
        unknown = [m for m in self.methods if split_method(m)[0] not in OURS + PEERS]
        if unknown:
            raise ConfigError(f"unknown bench method(s) {unknown}: choose from {', '.join(OURS + PEERS)}, "
                              "optionally NAME:RULE with an approximate rule (e.g. medusa:typical, bpd:topk=2)")
        for m in self.methods:
            name, rule = split_method(m)
            if rule != "exact" and name in PEERS:
                raise ConfigError(f"{m}: acceptance rules apply to speculant's own methods only")
            parse_acceptance(rule)
            if m.partition("@")[2] not in ("", *TREE_BUDGETS):
                raise ConfigError(f"{m}: a method's tree budget is @auto or @fixed")
            if "@" in m and name.removesuffix("+lookup") not in ("medusa", "hydra"):
                raise ConfigError(f"{m}: a tree budget (@auto, @fixed) applies to medusa and hydra only")
        if self.tree_budget not in TREE_BUDGETS:
            raise ConfigError(f"unknown --tree-budget {self.tree_budget!r}: choose {' or '.join(TREE_BUDGETS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"--methods lists a method twice: {','.join(self.methods)}")
        if "ar" not in self.methods:
            raise ConfigError("bench needs the 'ar' baseline in --methods: speed-ups are measured against it")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.target_quant != "none" and self.backend != "native":
            raise ConfigError("--target-quant needs --backend native")
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise ConfigError("--per-category and --max-new-tokens must be >= 1")
        if self.lookup_branch < 1:
            raise ConfigError(f"--lookup-branch must be >= 1 for the +lookup methods, got {self.lookup_branch}")


def split_method(m: str) -> tuple[str, str]:
    """``"bpd:topk=2"`` -> ``("bpd", "topk=2")``; ``"sd"`` -> ``("sd", "exact")``;
    ``"hydra+lookup@fixed"`` -> ``("hydra+lookup", "exact")`` (the budget: :func:`tree_budget_of`)."""
    name, _, rule = m.partition("@")[0].partition(":")
    return name, rule or "exact"


def tree_budget_of(m: str, default: str) -> str:
    """``"hydra@fixed"`` -> ``"fixed"``; a method without ``@`` -> ``default``."""
    return m.partition("@")[2] or default


def load_questions(path: str | None = None) -> list[dict]:
    """Spec-Bench questions; MT-bench's eight categories (ids 81-160) are grouped as mt_bench."""
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("speculant").joinpath("data/spec_bench_questions.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for r in rows:
        r["group"] = "mt_bench" if 81 <= r["question_id"] <= 160 else r["category"]
    return rows


def select(rows: list[dict], per_category: int, categories: tuple[str, ...] | None) -> list[dict]:
    cats = categories or CATEGORY_ORDER
    out = []
    for c in cats:
        picked = [r for r in rows if r["group"] == c][:per_category]
        if not picked:
            raise ConfigError(f"no questions in category {c!r}; categories: {', '.join(CATEGORY_ORDER)}")
        out += picked
    return out


class HFAssisted:
    """The peer: transformers' own ``generate(assistant_model=...)`` on the same two models."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(
                ids.view(1, -1), attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                assistant_model=self.draft.model, do_sample=False, max_new_tokens=max_new_tokens,
                pad_token_id=self.target.tokenizer.eos_token_id)
        return out[0, ids.shape[0]:].tolist(), time.perf_counter() - t


def run_bench(cfg: BenchConfig) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    methods = list(cfg.methods)
    if "llamacpp" in methods and (why := llamacpp_unavailable()):
        console.print(f"[yellow]skipping the llamacpp row: {why}[/yellow]")
        methods.remove("llamacpp")
    needs_draft = any(m in ("sd", "mcsd", "hf-assisted") for m in methods)
    # hf-assisted runs transformers models; the native backend shares their weights then. Without
    # it, the native backend loads lean (quantized layers read and quantized one at a time).
    lean = cfg.backend == "native" and "hf-assisted" not in methods
    if lean:
        target = load_native(cfg.target, cfg.dtype, cfg.target_quant, cfg.quant_head)
        draft = load_native(cfg.draft, cfg.dtype, _draft_quant(cfg), keep_dense=True) if needs_draft else None
    else:
        target = load(cfg.target, cfg.dtype)
        draft = load(cfg.draft, cfg.dtype) if needs_draft else None
    if draft is not None:
        check_vocab_compatible(target, draft)
    runners = {}
    ours_draft = None  # one (quantized) draft shared by sd and mcsd; hf-assisted gets the original
    ours_target = None  # one native target shared by every method of ours
    for m in methods:
        name, rule = split_method(m)
        if name == "hf-assisted":
            runners[m] = HFAssisted(target, draft)
            continue
        if name == "llamacpp":
            runners[m] = LlamaCppPlain(cfg.target, target.tokenizer)
            continue
        base, lookup = name.removesuffix("+lookup"), name.endswith("+lookup")
        tree = cfg.medusa_tree if base == "medusa" else cfg.tree if name == "mcsd" else None
        dec = SpeculativeDecoder(ours_target or target, (ours_draft or draft) if name in ("sd", "mcsd") else None,
                                 method=base, gamma=cfg.gamma,
                                 lookup_branch=cfg.lookup_branch if lookup else 0, tree=tree, replacement=cfg.replacement,
                                 heads=cfg.hydra_heads if base == "hydra" else cfg.heads, acceptance=rule,
                                 draft_quant="none" if (ours_draft or lean) else cfg.draft_quant,
                                 backend=cfg.backend, target_quant=cfg.target_quant, quant_head=cfg.quant_head,
                                 tree_budget=tree_budget_of(m, cfg.tree_budget))
        ours_draft = ours_draft or dec.draft
        ours_target = ours_target or dec.target
        runners[m] = dec
    questions = select(load_questions(cfg.questions), cfg.per_category, cfg.categories)
    tok = target.tokenizer
    encoded = [tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0]
               for q in questions]
    # warm-up: one short generation per method (first calls pay one-off allocation costs)
    for m, r in runners.items():
        _run_one(r, encoded[0], 8)
    runs = []
    for qi, (q, ids) in enumerate(zip(questions, encoded)):
        order = list(methods) if qi % 2 == 0 else list(reversed(methods))  # interleave
        for m in order:
            tokens, wall, stats = _run_one(runners[m], ids, cfg.max_new_tokens)
            row = {"method": m, "question_id": q["question_id"], "category": q["group"],
                   "new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": len(tokens) / wall,
                   "token_ids": tokens, "text": tok.decode(tokens, skip_special_tokens=True)}
            if q.get("reference"):
                row["reference"] = q["reference"][0]
            if stats is not None:
                row["stats"] = stats
            runs.append(row)
            console.print(f"[dim]{q['group']:>14} q{q['question_id']:<4} {m:>12}: {len(tokens):4d} tokens "
                          f"{wall:7.2f} s {len(tokens) / wall:6.2f} tok/s[/dim]")
    summary = summarize(runs, methods)
    quant = f", target {cfg.target_quant}" if cfg.target_quant != "none" else ""
    table = Table(title=f"speculant bench: {cfg.target} (draft {cfg.draft}), {cfg.dtype}, {cfg.backend} backend"
                        f"{quant}, greedy, {len(questions)} prompts x {cfg.max_new_tokens} new tokens")
    quality = any(s.get("bleu") is not None or s.get("math_em") is not None for s in summary.values())
    cols = ["method", "speedup", "tokens/s", "ms/token", "tokens/call", "acceptance", "same as ar"]
    cols += ["BLEU", "math EM"] if quality else []
    for col in cols:
        table.add_column(col, justify="right")
    for m, s in summary.items():
        cells = [m, f"{s['speedup']:.2f}x", f"{s['tokens_per_s']:.2f}", f"{1e3 / s['tokens_per_s']:.0f}",
                 f"{s['tokens_per_call']:.2f}" if s["tokens_per_call"] else "-",
                 f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] else "-",
                 f"{s['identical_to_ar']}/{s['prompts']}"]
        if quality:
            cells += [f"{s['bleu']:.1f}" if s.get("bleu") is not None else "-",
                      f"{s['math_em']:.2f}" if s.get("math_em") is not None else "-"]
        table.add_row(*cells)
    Console().print(table)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Console().print(f"peak RSS of this process (every model of the run loaded): {peak_gb:.2f} GB")
    result = {"config": {k: v for k, v in cfg.__dict__.items()}, "runs": runs, "summary": summary,
              "peak_rss_gb": peak_gb}
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=1))
    return result


def _draft_quant(cfg: BenchConfig) -> str:
    return auto_draft_quant(cfg.dtype, "native") if cfg.draft_quant == "auto" else cfg.draft_quant


def _run_one(runner, ids: torch.Tensor, max_new_tokens: int):
    if isinstance(runner, (HFAssisted, LlamaCppPlain)):
        tokens, wall = runner.run(ids, max_new_tokens)
        return tokens, wall, None
    t = time.perf_counter()
    res = runner.generate(ids, max_new_tokens)
    wall = time.perf_counter() - t
    return res.token_ids, wall, res.stats.to_dict()


def summarize(runs: list[dict], methods) -> dict:
    by = {m: [r for r in runs if r["method"] == m] for m in methods}
    ar_ids = {r["question_id"]: r["token_ids"] for r in by["ar"]}

    def tps(rs):
        return sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)

    base = tps(by["ar"])
    out = {}
    for m, rs in by.items():
        calls = sum(r["stats"]["target_calls"] for r in rs if "stats" in r)
        drafted = [r["stats"] for r in rs if "stats" in r]
        acc = sum(sum(s["accepted_per_call"]) for s in drafted)
        positions = sum(s["drafted_positions"] for s in drafted)
        out[m] = {
            "speedup": tps(rs) / base,
            "tokens_per_s": tps(rs),
            "tokens_per_call": sum(r["new_tokens"] for r in rs) / calls if calls else 0.0,
            "acceptance_rate": acc / positions if positions else 0.0,
            "identical_to_ar": sum(r["token_ids"] == ar_ids[r["question_id"]] for r in rs),
            "prompts": len(rs),
            **quality_scores(rs),
        }
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer of a math solution: the number after GSM8K's ``####`` if present, else the last
    number in the text; commas and a trailing ``.0`` dropped. None if there is no number."""
    if "####" in text:
        text = text.split("####")[-1]
    nums = _NUMBER.findall(text)
    if not nums:
        return None
    n = nums[-1].replace(",", "")
    return n[:-2] if n.endswith(".0") else n


def quality_scores(rows: list[dict]) -> dict:
    """``bleu``: sacrebleu corpus BLEU of the translation rows; ``math_em``: fraction of
    math_reasoning rows whose final number equals the reference's. None where no such rows."""
    out: dict = {"bleu": None, "math_em": None}
    tr = [r for r in rows if r["category"] == "translation" and r.get("reference")]
    if tr:
        import sacrebleu

        out["bleu"] = sacrebleu.corpus_bleu([r["text"].strip() for r in tr], [[r["reference"] for r in tr]]).score
    ma = [r for r in rows if r["category"] == "math_reasoning" and r.get("reference")]
    if ma:
        out["math_em"] = sum(final_number(r["text"]) == final_number(r["reference"]) for r in ma) / len(ma)
    return out
