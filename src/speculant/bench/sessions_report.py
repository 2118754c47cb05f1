"""The summary and tables of ``speculant bench --sessions`` (``bench.sessions_run``'s result).

``summarize(result)`` gives, per row, over the sessions every row completed (``compared``: a
session with a failed turn in any row is left out of every row, so the rows add up the same
turns):

- ``seconds``: the sum of the turns' wall times (client side, each from sending the request to the
  end of its stream), ``completion_tokens`` and ``tok_s`` = tokens / seconds (prefill included);
- ``ttft_median_s`` over all turns, ``ttft_first_median_s`` over each session's first turn (nothing
  cached but the warm-up's and the earlier sessions' prefixes) and ``ttft_later_median_s`` over the
  later turns (where a prompt cache has the history), None without such turns;
- ``prompt_tokens`` (the turns' sum), ``cached_tokens`` and ``cached_share`` (cached over prompt
  tokens, both over the turns whose server reported cached tokens; None when none did);
- ``per_session``: ``{id: {"seconds", "tok_s", "ttft_s": [per turn]}}``;
- ``same_as_plain``: how many turns give the text (and tool calls) of the same turn of the plain row
  of the same runtime (``ar`` for speculant's rows, ``llama-server`` for llama.cpp's), of how many;
  None without that row. Greedy and lossless, speculant's rows give ``ar``'s answers, so their
  histories, and so their prompts, are the same; llama.cpp's weights and kernels differ, so its
  answers may differ from speculant's, and from there on the two replay different histories;
- ``vs_best_peer`` (speculant's rows; the best peer = the llama-server row of the most tok/s):
  ``tok_s`` (ours / the peer's), ``seconds`` (the peer's / ours), ``ttft`` and ``ttft_later``
  (the peer's median / ours) and ``per_session`` seconds (the peer's / ours): above 1 = faster.
"""

from __future__ import annotations

import statistics
from typing import Any

from .methods import LLAMA_SERVER as _LLAMA

__all__ = ["format_tables", "print_tables", "row_summary", "summarize"]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def row_summary(played: list[dict], compared: set[str]) -> dict[str, Any]:
    """One row's summary over the sessions ``compared`` (see the module docstring)."""
    runs = [s for s in played if s["id"] in compared and s["error"] is None]
    turns = [t for s in runs for t in s["turns"]]
    seconds = sum(t["wall_s"] for t in turns)
    tokens = sum(t["completion_tokens"] for t in turns)
    reported = [t for t in turns if t.get("cached_tokens") is not None and t.get("prompt_tokens")]
    cached = sum(t["cached_tokens"] for t in reported) if reported else None
    return {"sessions": len(runs), "turns": len(turns), "seconds": seconds, "completion_tokens": tokens,
            "tok_s": tokens / seconds if seconds > 0 else 0.0,
            "ttft_median_s": _median([t["ttft_s"] for t in turns]),
            "ttft_first_median_s": _median([t["ttft_s"] for t in turns if t["turn"] == 1]),
            "ttft_later_median_s": _median([t["ttft_s"] for t in turns if t["turn"] > 1]),
            "prompt_tokens": sum(t.get("prompt_tokens") or 0 for t in turns), "cached_tokens": cached,
            "cached_share": cached / sum(t["prompt_tokens"] for t in reported) if reported else None,
            "per_session": {s["id"]: {"seconds": sum(t["wall_s"] for t in s["turns"]),
                                      "tok_s": _tok_s(s["turns"]), "ttft_s": [t["ttft_s"] for t in s["turns"]]}
                            for s in runs}}


def _tok_s(turns: list[dict]) -> float:
    wall = sum(t["wall_s"] for t in turns)
    return sum(t["completion_tokens"] for t in turns) / wall if wall > 0 else 0.0


def _answers(played: list[dict], compared: set[str]) -> dict[tuple[str, int], tuple]:
    return {(s["id"], t["turn"]): (t["text"], tuple((c["function"]["name"], c["function"]["arguments"])
                                                    for c in t.get("tool_calls") or []))
            for s in played if s["id"] in compared for t in s["turns"]}


def _base(row: str) -> str:
    return row.split("@", 1)[0]


def summarize(result: dict) -> dict[str, Any]:
    """``{"compared": [session ids], "left_out": {id: why}, "best_peer": row | None, "rows": {row: ...}}``."""
    rows = result["rows"]
    ids = [s["id"] for s in result["sessions_file"]["sessions"]]
    left_out = {}
    for name, r in rows.items():
        for s in r["sessions"]:
            if s["error"] is not None and s["id"] not in left_out:
                left_out[s["id"]] = f"{name}: {s['error']}"
    compared = {i for i in ids if i not in left_out}
    out = {name: row_summary(r["sessions"], compared) for name, r in rows.items()}
    for name, s in out.items():
        plain = "llama-server" if _base(name) in _LLAMA else "ar"
        if plain in rows and name != plain:
            ref, own = _answers(rows[plain]["sessions"], compared), _answers(rows[name]["sessions"], compared)
            s["same_as_plain"] = [sum(ref.get(k) == v for k, v in own.items()), len(own)]
        else:
            s["same_as_plain"] = None
    peers = [n for n in out if _base(n) in _LLAMA and out[n]["turns"]]
    best = max(peers, key=lambda n: out[n]["tok_s"]) if peers else None
    for name, s in out.items():
        if best is None or _base(name) in _LLAMA:
            s["vs_best_peer"] = None
            continue
        p = out[best]
        s["vs_best_peer"] = {
            "peer": best, "tok_s": _ratio(s["tok_s"], p["tok_s"]), "seconds": _ratio(p["seconds"], s["seconds"]),
            "ttft": _ratio(p["ttft_median_s"], s["ttft_median_s"]),
            "ttft_later": _ratio(p["ttft_later_median_s"], s["ttft_later_median_s"]),
            "per_session": {i: _ratio(p["per_session"][i]["seconds"], v["seconds"])
                            for i, v in s["per_session"].items() if i in p["per_session"]}}
    return {"compared": [i for i in ids if i in compared], "left_out": left_out, "best_peer": best, "rows": out}


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def _at(session: dict | None, k: int) -> float | None:
    return session["ttft_s"][k] if session is not None and k < len(session["ttft_s"]) else None


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def format_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The tables as (title, headers, rows of cells): the rows' summary, seconds per session, and
    the time to first token of every turn."""
    summary = result["summary"]
    rows = summary["rows"]
    best = summary["best_peer"]
    head = ["row", "seconds", "tok/s", "TTFT\nmedian", "TTFT\nturn 1", "TTFT\nlater", "cached", "vs best\npeer",
            "same as\nplain"]
    body = []
    for name, s in rows.items():
        vs = s["vs_best_peer"]
        same = "-" if s["same_as_plain"] is None else f"{s['same_as_plain'][0]}/{s['same_as_plain'][1]}"
        body.append([name, f"{s['seconds']:.1f}", f"{s['tok_s']:.2f}", _ms(s["ttft_median_s"]),
                     _ms(s["ttft_first_median_s"]), _ms(s["ttft_later_median_s"]),
                     "-" if s["cached_share"] is None else f"{s['cached_share']:.0%}",
                     ("1.00x" if name == best else "-") if vs is None else _x(vs["tok_s"]), same])
    kinds = {s["id"]: (s["kind"], s["turns"]) for s in result["sessions_file"]["sessions"]}
    per_session = [[i, kinds[i][0], str(kinds[i][1]),
                    *(f"{rows[n]['per_session'][i]['seconds']:.1f}" if i in rows[n]["per_session"] else "-"
                      for n in rows)] for i in summary["compared"]]
    ttft = [[i if k == 0 else "", str(k + 1), *(_ms(_at(rows[n]["per_session"].get(i), k)) for n in rows)]
            for i in summary["compared"] for k in range(kinds[i][1])]
    title = (f"bench --sessions, sessions compared: {len(summary['compared'])} "
             f"(TTFT: time to first token, median ms; vs best peer: tok/s over {best or 'the best peer'}'s)")
    return [(title, head, body),
            ("seconds per session", ["session", "kind", "turns", *rows], per_session),
            ("time to first token of each turn, ms", ["session", "turn", *rows], ttft)]


def print_tables(result: dict) -> None:
    """The tables (:func:`format_tables`) and the rows that did not run, on standard output."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for title, headers, body in format_tables(result) if result["summary"]["rows"] else []:
        t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", padding=0)
        for i, h in enumerate(headers):
            if i == 0:  # long row names (llama-server+ngram-mod) fold inside their column
                t.add_column(h, justify="left", overflow="fold", min_width=12, max_width=22)
            else:
                t.add_column(h, justify="right", no_wrap=True)
        for r in body:
            t.add_row(*r)
        console.print(t)
    for name, why in {**result["skipped"], **result["failed"]}.items():
        console.print(f"{name}: not run: {why}", markup=False)
    for sid, why in result["summary"]["left_out"].items():
        console.print(f"session {sid} left out of the comparison: {why}", markup=False)
