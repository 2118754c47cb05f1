"""The README's headline: speculant's default against the best peer row of the same run, one
clause per CPU, each from one clean bench run (its JSON), so that no figure of it is typed by hand.

The block sits between ``<!-- headline:begin -->`` and ``<!-- headline:end -->``. Each clause names
its CPU (a label the writer chooses, e.g. "an Intel Xeon with AMX": a bench JSON records the CPU's
model name and flags, not its generation) and links the run it comes from; :func:`readme_runs`
reads those labels and links back, so the block can be made again from the README alone and a test
checks that it is what its runs say.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ConfigError
from .report import QUANT_NOTES, full_summary, load_result

HEAD_BEGIN, HEAD_END = "<!-- headline:begin -->", "<!-- headline:end -->"
_CLAUSE = re.compile(r"\[([^\]]+)\]\(([^)]+\.json)\)")


def clause(label: str, result: dict, link: str) -> str:
    """``auto``'s speed over the best peer row of ``result``, prefill included, then decoding
    alone, and that peer row: ``"1.72x (1.57x) over `llama-server+ngram-mod` on [an AMD EPYC Zen 5](...json)
    (2026-12-03, 31608de; int4 weights)"`` (the target's quantization in that run, where it records one).
    Raises ConfigError for a run from a tree with uncommitted changes, or without an ``auto`` row
    and a peer row beside it."""
    if result.get("dirty") or result.get("changed_during_run"):
        raise ConfigError(f"{link} was measured from a tree with uncommitted changes (or one that changed during "
                          "the run): the headline takes clean runs at a commit only")
    auto = full_summary(result).get("auto") or {}
    prefill, decode = auto.get("vs_best_peer"), auto.get("decode_vs_best_peer")
    if not prefill or not decode:
        raise ConfigError(f"{link} has no auto row with a peer row beside it: run the bench with --methods "
                          "ar,auto,llama-server,... (make install-peers)")
    when = f"{str(result.get('date') or '')[:10]}, {str(result.get('commit') or '')[:7]}"
    quant = (result.get("config") or {}).get("target_quant")
    when += f"; {QUANT_NOTES[quant]}" if quant in QUANT_NOTES else ""
    return f"{prefill:.2f}x ({decode:.2f}x) over `{auto.get('best_peer')}` on [{label}]({link}) ({when})"


def headline(runs: list[tuple[str, dict, str]]) -> str:
    """The headline sentence of ``runs`` ((label, result, link) each, in the order given)."""
    if not runs:
        raise ConfigError("the headline needs at least one run: give LABEL=FILE.json")
    clauses = [clause(label, result, link) for label, result, link in runs]
    return ("On the same weights and prompts, speculant's default against the fastest peer row measured "
            "beside it in the same run (llama.cpp's `llama-server`, plain and with its speculation, and "
            "OpenVINO GenAI where it was installed), prefill included (decoding alone in brackets): "
            + "; ".join(clauses) + ".")


def readme_runs(readme: str | Path) -> list[tuple[str, str]]:
    """(label, link) of each clause of ``readme``'s headline block, in order (links relative to
    the README)."""
    return _CLAUSE.findall(_block(Path(readme).read_text())[1])


def update_headline(readme: str | Path, specs: list[str]) -> str:
    """Write the headline of ``specs`` (``"LABEL=FILE.json"`` each) into ``readme``'s block;
    returns it."""
    p = Path(readme)
    runs = []
    for spec in specs:
        label, sep, file = spec.rpartition("=")
        if not sep or not label or not file.endswith(".json"):
            raise ConfigError(f"--headline {spec!r}: write LABEL=FILE.json, e.g. "
                              "'an AMD EPYC Zen 5=benchmarks/2026-12-03-amd-epyc-zen5-bench.json'")
        link = Path(os.path.relpath(Path(file).resolve(), p.resolve().parent)).as_posix()
        runs.append((label, load_result(Path(file)), link))
    text = headline(runs)
    head, _, tail = _block(p.read_text())
    p.write_text(f"{head}{HEAD_BEGIN}\n{text}\n{HEAD_END}{tail}")
    return text


def readme_headline(readme: str | Path) -> tuple[str, str]:
    """(the headline block's text as it is, the headline its own clauses' runs give)."""
    p = Path(readme)
    runs = [(label, load_result(p.parent / link), link) for label, link in readme_runs(p)]
    return _block(p.read_text())[1].strip(), headline(runs)


def _block(text: str) -> tuple[str, str, str]:
    """(what comes before the begin marker, the block's text, what comes after the end marker)."""
    start, end = text.find(HEAD_BEGIN), text.find(HEAD_END)
    if start < 0 or end < start:
        raise ConfigError(f"no '{HEAD_BEGIN}' ... '{HEAD_END}' pair: put both markers, in that order, where the "
                          "headline goes")
    return text[:start], text[start + len(HEAD_BEGIN):end], text[end + len(HEAD_END):]
