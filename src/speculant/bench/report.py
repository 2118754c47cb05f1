"""The bench's summary and how it is shown: the per-method summary of a run, its 80-column
terminal tables, a Markdown results table, and reading saved bench JSON files.

Summary (per method; key, then its column in the tables):

- ``tokens_per_s`` (tok/s): new tokens / wall time over all prompts, prefill included;
- ``decode_tokens_per_s`` (decode tok/s): new tokens / (wall time - prefill time). Prefill: ours,
  the target's prefill forward (``Stats.prefill_s``; a draft model's own prefill counts as
  decoding); llama-server, its ``prompt_ms``; OpenVINO, its time to first token; hf-assisted, the
  time to its first streamed block (both models' prefill and the first draft-and-verify step);
- ``speedup`` / ``decode_speedup`` (vs ar): over our ``ar`` row;
- ``vs_best_peer`` / ``decode_vs_best_peer`` (vs peer): over the fastest peer row of the run
  (every peer row counts, hf-assisted too), chosen separately for each rate (``best_peer``,
  ``best_peer_decode``); None when no peer row ran;
- ``tokens_per_call`` (τ): ours from the decoder (tokens per target call, EOS counted as the
  decoder counts it); ``openvino+draft`` from OpenVINO's own counts (generated tokens / target
  model inferences, the prefill included: it yields the first token); otherwise 0 ("-");
- ``acceptance_rate`` (α): ours from the decoder; ``llama-server+draft`` / ``+ngram`` and
  ``openvino+draft`` from the runtime's own counts (accepted / drafted tokens; their drafts are
  chains); 0 ("-") where not reported (``openvino+lookup`` reports none);
- ``identical_to_plain`` (same as plain): prompts whose output equals that of the row's own
  runtime's plain decoding (``plain``, see ``methods.plain_of``); None ("-") when that plain row is
  not in the run. ``identical_to_ar`` compares every row with ``ar``;
- ``target_nll`` (nll; with ``--temperature`` only): the mean -log p_T of the generated tokens
  under the target at that temperature; lossless methods sample p_T, so theirs matches ``ar``'s
  up to sampling noise, while an approximate rule that favours likely tokens lowers it. Sampled
  outputs are not compared (``identical_to_plain`` and ``identical_to_ar`` are None): the tables
  show the nll in the place of same as plain;
- ``bleu``, ``math_em``: corpus BLEU (sacrebleu) on ``translation`` and exact match of the final
  number on ``math_reasoning`` (GSM8K's ``#### N``), where Spec-Bench has references.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import ConfigError
from .methods import is_peer, plain_of, row_quant, split_method

CATEGORY_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
CATEGORY_SHORT = {"mt_bench": "mt", "translation": "transl", "summarization": "summ", "qa": "qa",
                  "math_reasoning": "math", "rag": "rag"}
WIDTH = 80  # the terminal tables fit this many columns
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def cut_at_eos(tokens, eos_token_ids) -> tuple[list[int], bool]:
    """``tokens`` up to their first EOS id, the EOS excluded, and whether there was one."""
    tokens = [int(t) for t in tokens]
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[:i], True
    return tokens, False


def _rates(rs: list[dict]) -> tuple[float, float]:
    """(tokens/s with prefill, tokens/s of decoding alone) over rows ``rs``."""
    n = sum(r["new_tokens"] for r in rs)
    wall = sum(r["wall_s"] for r in rs)
    decode = sum(max(r["wall_s"] - r.get("prefill_s", 0.0), 0.0) for r in rs)
    return (n / wall if wall > 0 else 0.0), (n / decode if decode > 0 else 0.0)


def _calls_and_acceptance(rs: list[dict]) -> tuple[float, float]:
    """(τ, α) of rows ``rs`` (see the module docstring); 0.0 where not known."""
    ours = [r for r in rs if "stats" in r]
    if ours:
        calls = sum(r["stats"]["target_calls"] for r in ours)
        # the decoder's own token count: the answer plus the EOS it stopped at
        tokens = sum(r["new_tokens"] + bool(r.get("eos")) for r in ours)
        acc = sum(sum(r["stats"]["accepted_per_call"]) for r in ours)
        positions = sum(r["stats"]["drafted_positions"] for r in ours)
        return (tokens / calls if calls else 0.0), (acc / positions if positions else 0.0)
    t = [r["timing"] for r in rs if r.get("timing")]

    def total(key):
        return sum(x.get(key) or 0 for x in t)

    tau = total("num_generated_tokens") / total("target_calls") if total("target_calls") else 0.0
    if total("draft_n"):  # llama-server
        return tau, total("draft_n_accepted") / total("draft_n")
    if total("num_draft_tokens"):  # OpenVINO
        return tau, total("num_accepted_tokens") / total("num_draft_tokens")
    return tau, 0.0


def _categories(runs: list[dict]) -> list[str]:
    cats = [c for c in CATEGORY_ORDER if any(r["category"] == c for r in runs)]
    return cats + sorted({r["category"] for r in runs} - set(cats))


def summarize(runs: list[dict], methods, eos_token_ids=(), sampled: bool = False) -> dict:
    """Per method, over its rows of ``runs``: the rates, ratios, τ, α, output identity and quality
    of the module docstring. Outputs are compared cut at their first id in ``eos_token_ids``;
    ``sampled`` outputs are not compared."""
    eos = set(eos_token_ids)
    by = {m: [r for r in runs if r["method"] == m] for m in methods}
    by = {m: rs for m, rs in by.items() if rs}
    ids = {m: {r["question_id"]: cut_at_eos(r["token_ids"], eos)[0] for r in rs} for m, rs in by.items()}
    rates = {m: _rates(rs) for m, rs in by.items()}
    peer_rows = [m for m in by if is_peer(m)]
    best = max(peer_rows, key=lambda m: rates[m][0], default=None)
    best_decode = max(peer_rows, key=lambda m: rates[m][1], default=None)
    base, base_decode = rates["ar"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    cats = _categories(runs)
    out = {}
    for m, rs in by.items():
        tps, decode = rates[m]
        tau, alpha = _calls_and_acceptance(rs)
        plain = plain_of(m)
        out[m] = {
            "speedup": tps / base,
            "decode_speedup": ratio(decode, base_decode),
            "tokens_per_s": tps,
            "decode_tokens_per_s": decode,
            "prefill_s": sum(r.get("prefill_s", 0.0) for r in rs),
            "wall_s": sum(r["wall_s"] for r in rs),
            "new_tokens": sum(r["new_tokens"] for r in rs),
            "vs_best_peer": ratio(tps, rates[best][0]) if best else None,
            "decode_vs_best_peer": ratio(decode, rates[best_decode][1]) if best_decode else None,
            "best_peer": best,
            "best_peer_decode": best_decode,
            "tokens_per_call": tau,
            "acceptance_rate": alpha,
            "identical_to_ar": None if sampled else sum(ids[m][q] == ids["ar"].get(q) for q in ids[m]),
            "plain": plain,
            "identical_to_plain": sum(ids[m][q] == ids[plain].get(q) for q in ids[m])
            if plain in by and not sampled else None,
            "target_nll": _mean_nll(rs),
            "prompts": len(rs),
            "tokens_per_s_by_category": {c: _rates([r for r in rs if r["category"] == c])[0]
                                         for c in cats if any(r["category"] == c for r in rs)},
            **quality_scores(rs),
        }
    return out


def _mean_nll(rs: list[dict]) -> float | None:
    """The tokens' mean target NLL over rows ``rs`` (weighted by their tokens), None without it."""
    scored = [r for r in rs if r.get("target_nll") is not None]
    n = sum(r["new_tokens"] for r in scored)
    return sum(r["target_nll"] * r["new_tokens"] for r in scored) / n if n else None


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


# ------------------------------------------------------------------------------------------------
# terminal tables
# ------------------------------------------------------------------------------------------------

def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _num(v, fmt: str = ".2f") -> str:
    return format(v, fmt) if v else "-"


LEGEND = ("tok/s: new tokens per second, prefill included; decode: without the prefill; vs ar, vs peer: "
          "ratio to the ar row and to the fastest peer row; τ: tokens per target call; α: drafted tokens "
          "accepted; ")
SAME_LEGEND = "same: outputs equal to the plain row of the same runtime (ar, llama-server, openvino)"
NLL_LEGEND = ("nll: mean -log p_T of the sampled tokens under the target at the bench's temperature (outputs "
              "are not compared when sampling; a lossless row's nll matches ar's up to sampling noise, a lower "
              "one = an approximate rule favouring likely tokens)")


def is_sampled(summary: dict) -> bool:
    """Whether the summary is of a sampled run (``--temperature`` > 0): its rows carry a target NLL."""
    return any(s.get("target_nll") is not None for s in summary.values())


def _table(headers: list[str]):
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=0)  # columns one space apart
    for i, h in enumerate(headers):
        if i == 0:  # long method specs (hydra+lookup@heads=DIR) wrap inside their column
            t.add_column(h, justify="left", overflow="fold", max_width=20)
        else:
            t.add_column(h, justify="right", no_wrap=True)
    return t


def print_summary(summary: dict, title: str) -> None:
    """The summary table (one row per method; the legend under it), the best peer, then tokens/s
    and quality by category; every line within 80 columns, no header cut."""
    from rich.console import Console

    sampled = is_sampled(summary)  # sampled outputs are not compared: the last column is the target NLL
    table = _table(["method", "tok/s", "decode\ntok/s", "vs ar", "decode\nvs ar", "vs\npeer", "decode\nvs peer",
                    "τ", "α", "nll" if sampled else "same"])
    for m, s in summary.items():
        table.add_row(m, f"{s['tokens_per_s']:.2f}", _num(s.get("decode_tokens_per_s")), _x(s.get("speedup")),
                      _x(s.get("decode_speedup")), _x(s.get("vs_best_peer")), _x(s.get("decode_vs_best_peer")),
                      _num(s.get("tokens_per_call")), _num(s.get("acceptance_rate")), _last_cell(s, sampled))
    first: dict = next(iter(summary.values()), {})
    best, best_decode = first.get("best_peer"), first.get("best_peer_decode")
    if best:
        note = f"best peer: {best} ({summary[best]['tokens_per_s']:.2f} tok/s, prefill included)"
        if best_decode:
            note += f"; by decode tok/s: {best_decode} ({summary[best_decode]['decode_tokens_per_s']:.2f})"
    else:
        note = "no peer rows in this run: vs peer is -"
    cats = list(dict.fromkeys(c for s in summary.values() for c in s.get("tokens_per_s_by_category", {})))
    quality = any(s.get("bleu") is not None or s.get("math_em") is not None for s in summary.values())
    by_cat = _table(["method", *(CATEGORY_SHORT.get(c, c) for c in cats)] + (["BLEU", "math\nEM"] if quality else []))
    for m, s in summary.items():
        per = s.get("tokens_per_s_by_category", {})
        cells = [f"{per[c]:.2f}" if c in per else "-" for c in cats]
        if quality:
            cells += [f"{s['bleu']:.1f}" if s.get("bleu") is not None else "-",
                      f"{s['math_em']:.2f}" if s.get("math_em") is not None else "-"]
        by_cat.add_row(m, *cells)
    short = [f"{CATEGORY_SHORT[c]} = {c}" for c in cats if CATEGORY_SHORT.get(c, c) != c]
    console = Console(width=WIDTH)
    console.print(title, style="italic", markup=False, highlight=False)
    console.print(table)
    console.print(LEGEND + (NLL_LEGEND if sampled else SAME_LEGEND), style="dim", markup=False, highlight=False)
    console.print(note, markup=False, highlight=False)
    console.print("tokens/s by category, prefill included" + (f" ({', '.join(short)})" if short else "")
                  + ("; BLEU on translation, exact match of the final number on math" if quality else ""),
                  style="italic", markup=False, highlight=False)
    console.print(by_cat)


def _last_cell(s: dict, sampled: bool) -> str:
    """The table's last cell of summary row ``s``: its target NLL (sampled), else same-as-plain."""
    if sampled:
        return f"{s['target_nll']:.2f}" if s.get("target_nll") is not None else "-"
    same = s.get("identical_to_plain")
    return f"{same}/{s['prompts']}" if same is not None else "-"


# ------------------------------------------------------------------------------------------------
# saved results: reading them, the Markdown table, the README section
# ------------------------------------------------------------------------------------------------

def load_result(path: str | Path) -> dict:
    """A bench JSON as ``speculant bench --json-out`` writes it (a ``summary`` with an ``ar`` row)."""
    p = Path(path)
    try:
        result = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the bench JSON {p}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{p} is not JSON ({e}): give a file written by `speculant bench --json-out`") from None
    if not isinstance(result, dict) or "ar" not in (result.get("summary") or {}):
        raise ConfigError(f"{p} is not a bench result (no summary with an 'ar' row): give a file written by "
                          "`speculant bench --json-out`")
    return result


def newest_result(directory: str | Path = "benchmarks") -> Path:
    """The newest bench JSON in ``directory`` (by the ``date`` it records, then by name) among the
    runs that used every instruction the CPU has (no ``machine.env``: see ``harness.CAPPING_ENV``)."""
    d = Path(directory)
    found = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and "ar" in (r.get("summary") or {}) and not (r.get("machine") or {}).get("env"):
            found.append((str(r.get("date") or ""), p.name, p))
    if not found:
        raise ConfigError(f"no bench JSON in {d}/: pass the file to show, or run `speculant bench --json-out FILE`")
    return max(found)[2]


def peer_rows(result: dict) -> list[str]:
    """The run's peer rows: the current peers and any other runtime the JSON lists under ``peers``."""
    listed = set(result.get("peers") or {})
    return [m for m in result["summary"] if is_peer(m) or m in listed]


def by_category(result: dict) -> dict[str, dict[str, float]]:
    """Per method, tokens/s per category (prefill included): the summary's, else from the runs."""
    out = {}
    runs = result.get("runs") or []
    cats = _categories(runs)
    for m, s in result["summary"].items():
        if s.get("tokens_per_s_by_category"):
            out[m] = dict(s["tokens_per_s_by_category"])
        else:
            rs = [r for r in runs if r["method"] == m]
            out[m] = {c: _rates([r for r in rs if r["category"] == c])[0] for c in cats
                      if any(r["category"] == c for r in rs)}
    return out


def vs_best_peer(result: dict) -> dict[str, float | None]:
    """Per method, tokens/s over the fastest peer row's (the summary's, else from its rates)."""
    peers = peer_rows(result)
    s = result["summary"]
    best = max((s[m]["tokens_per_s"] for m in peers), default=None)
    return {m: v.get("vs_best_peer", v["tokens_per_s"] / best if best else None) for m, v in s.items()}


def row_label(result: dict, m: str) -> str:
    """``m``, with what it resolved to where the run recorded it (``auto (hydra+lookup)``)."""
    resolved = (result.get("resolved") or {}).get(m)
    return f"{m} ({resolved['method']})" if resolved else m


def full_summary(result: dict) -> dict:
    """The JSON's summary with what an older bench did not record filled in from its runs and rows:
    tokens/s by category, the ratio to the best peer, same-as-plain for rows compared with ar."""
    s = {m: dict(v) for m, v in result["summary"].items()}
    peers = peer_rows(result)
    best = max(peers, key=lambda m: s[m]["tokens_per_s"], default=None)
    ratio, per_cat = vs_best_peer(result), by_category(result)
    for m, v in s.items():
        v.setdefault("tokens_per_s_by_category", per_cat[m])
        v.setdefault("vs_best_peer", ratio[m])
        v.setdefault("best_peer", best)
        if "identical_to_plain" not in v and "identical_to_ar" in v:
            v["identical_to_plain"] = v["identical_to_ar"] if m not in peers and plain_of(m) == "ar" else None
    return s


def machine_line(result: dict) -> str:
    """``AMD EPYC (avx512_vnni, avx512_bf16, no AMX; 2 cores)`` from the JSON's machine record."""
    m = result.get("machine") or {}
    every = list(m.get("flags") or ())
    flags = [f for f in every if f.startswith(("avx512_", "amx_", "avx_vnni"))]
    if every and not any(f.startswith("avx512") for f in every):  # an AVX2 machine: say it
        flags = [f for f in every if f in ("avx2", "avx_vnni")] + ["no AVX-512"]
    cores = f"{m['cores']} cores" if m.get("cores") else ""
    isa = ", ".join(flags) + (", no AMX" if every and not any(f.startswith("amx") for f in flags) else "")
    env = " ".join(f"{k}={v}" for k, v in (m.get("env") or {}).items())
    inner = "; ".join(x for x in (isa.strip(", "), cores, f"run with {env}" if env else "") if x)
    return f"{m.get('cpu') or 'unknown CPU'}" + (f" ({inner})" if inner else "")


def command_of(result: dict) -> str:
    """The recorded command, as a user would type it (``speculant ...``, not the script's path)."""
    cmd = str(result.get("command") or "")
    first, _, rest = cmd.partition(" ")
    if first.endswith(("speculant/cli.py", "speculant/cli/__main__.py", "speculant/cli/commands.py", "/speculant")):
        return f"speculant {rest}".strip()
    return cmd or "not recorded"


def caption(result: dict, link: str | None = None, markdown: bool = True) -> str:
    """One line: CPU, date, the exact command, and a link to the raw JSON."""
    date = str(result.get("date") or "")[:10] or "undated"
    cfg = result.get("config") or {}
    runtime = {"native": "speculant's native runtime", "hf": "transformers"}.get(cfg.get("backend"), "")
    quant = cfg.get("target_quant") if cfg.get("target_quant") not in (None, "none", "auto") else cfg.get("dtype")
    weights = QUANT_NOTES.get(quant, f"{quant} weights") if quant else ""
    runtime = f" on {runtime}" + (f", {weights}" if weights else "") if runtime else ""
    what = (f"{cfg.get('target')}{runtime}, {result['summary']['ar'].get('prompts', '?')} Spec-Bench prompts x "
            f"{cfg.get('max_new_tokens')} new tokens" if cfg.get("target") else "")
    if what and (cfg.get("temperature") or 0) > 0:
        what += f", sampled at temperature {cfg['temperature']:g}"
    head = f"{machine_line(result)}, {date}" + (f"; {what}" if what else "")
    if not markdown:
        return f"{head}. Command: {command_of(result)}" + (f". Raw data: {link}" if link else "")
    raw = f" Raw data: [{Path(link).name}]({link})." if link else ""
    peers = " (the peer rows: `make install-peers`)" if any(is_peer(m) for m in result["summary"]) else ""
    return f"{head}. Command: `{command_of(result)}`{peers}.{raw}"


ROW_NOTES = {
    "ar": "speculant, plain decoding", "auto": "speculant's default", "sd": "speculant, draft model",
    "mcsd": "speculant, draft model, tree", "lookup": "speculant, prompt lookup", "medusa": "speculant, Medusa heads",
    "medusa+lookup": "speculant, Medusa heads + prompt lookup", "hydra": "speculant, Hydra heads",
    "hydra+lookup": "speculant, Hydra heads + prompt lookup", "eagle": "speculant, EAGLE drafter",
    "eagle+lookup": "speculant, EAGLE drafter + prompt lookup", "bpd": "speculant, blockwise parallel decoding",
    "hf-assisted": "transformers, assisted generation", "llama-server": "llama.cpp, plain",
    "llama-server+draft": "llama.cpp, draft model", "llama-server+ngram": "llama.cpp, n-gram lookup",
    "llama-server+ngram-mod": "llama.cpp, n-gram lookup (ngram-mod)",
    "llama-server+ngram-map-k": "llama.cpp, n-gram lookup (ngram-map-k)",
    "openvino": "OpenVINO GenAI, plain", "openvino+lookup": "OpenVINO GenAI, prompt lookup",
    "openvino+draft": "OpenVINO GenAI, draft model",
}


QUANT_NOTES = {"gguf": "the GGUF file's own blocks", "int4": "int4 weights", "int8": "int8 weights",
               "none": "unquantized weights"}


def _row_note(result: dict, m: str) -> str:
    name = split_method(m)[0]
    quant = row_quant(m)
    on = f", {QUANT_NOTES.get(quant, quant)}" if quant else ""
    resolved = (result.get("resolved") or {}).get(m)
    if resolved:
        return f"{ROW_NOTES.get(name, name)}{on}: {resolved['method']}"
    if name in ROW_NOTES:
        return ROW_NOTES[name] + on
    runtime = ((result.get("peers") or {}).get(m) or {}).get("runtime")
    return f"peer: {runtime}" if runtime else ""


def markdown_table(result: dict, link: str | None = None) -> str:
    """The results table in Markdown: a caption line (CPU, date, command, link to the JSON), then
    one row per method, the fastest rate of each rate column in bold, and a note on the columns."""
    s = full_summary(result)
    peers = set(peer_rows(result))
    tps = {m: v["tokens_per_s"] for m, v in s.items()}
    dec = {m: v.get("decode_tokens_per_s") or 0.0 for m, v in s.items()}
    best_peer_dec = max((dec[m] for m in peers), default=0.0)

    def bold(text: str, win: bool) -> str:
        return f"**{text}**" if win and text != "–" else text

    sampled = is_sampled(s)
    lines = [f"*{caption(result, link)}*", "",
             "| method | tok/s | decode tok/s | vs `ar` | vs best peer | decode vs best peer | τ | "
             + ("target nll |" if sampled else "same as plain |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, v in s.items():
        note = _row_note(result, m)
        cells = [f"`{m}`" + (f" ({note})" if note else ""),
                 bold(f"{v['tokens_per_s']:.2f}", tps[m] == max(tps.values())),
                 bold(_num(v.get("decode_tokens_per_s")), dec[m] > 0 and dec[m] == max(dec.values())),
                 _x(v.get("speedup")), _x(v.get("vs_best_peer")),
                 _x(v.get("decode_vs_best_peer", dec[m] / best_peer_dec if dec[m] and best_peer_dec else None)),
                 _num(v.get("tokens_per_call")), _last_cell(v, sampled)]
        lines.append("| " + " | ".join(c if c != "-" else "–" for c in cells) + " |")
    ours = [v for m, v in s.items() if m not in peers and v.get("identical_to_plain") is not None]
    lossless = ours and all(v["identical_to_plain"] == v["prompts"] for v in ours)
    if sampled:
        last = ("Target nll: the mean −log p_T of the sampled tokens under the target at the bench's temperature "
                "(sampled outputs are not compared; a lossless row's matches `ar`'s up to sampling noise, a lower "
                "one comes from an approximate rule that favours likely tokens).")
    else:
        last = ("Same as plain: prompts whose output equals plain decoding on the same runtime (`ar` for "
                "speculant's rows)" + (f"; every speculant row matches it on all {ours[0]['prompts']}." if lossless
                                       else "."))
    lines += ["", "tok/s: new tokens per second, the prompt's prefill included; decode: without it. τ: tokens per "
              "target pass. " + last]
    return "\n".join(lines) + "\n"


def update_readme(readme: str | Path, result: dict, json_path: str | Path) -> None:
    """Replace the text between ``<!-- results:begin -->`` and ``<!-- results:end -->`` in ``readme``
    with the results table of ``result``, linking ``json_path`` relative to the README."""
    p = Path(readme)
    if result.get("dirty") or result.get("changed_during_run"):
        raise ConfigError(f"{json_path} was measured from a tree with uncommitted changes (or one that changed "
                          "during the run): the README's table comes from a clean run at a commit; commit, run the "
                          "bench again, then update the README from that run")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror}") from None
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ConfigError(f"{p} has no '{BEGIN}' ... '{END}' pair: put both markers, in that order, around "
                          "the place where the results table goes")
    link = Path(os.path.relpath(Path(json_path).resolve(), p.resolve().parent)).as_posix()
    new = text[: start + len(BEGIN)] + "\n" + markdown_table(result, link) + text[end:]
    p.write_text(new)
