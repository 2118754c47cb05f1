"""The serving benchmark: ``speculant serve`` against llama.cpp's ``llama-server``.

Every server runs as its own process on loopback and is sent the same chat requests through its
OpenAI-compatible ``/v1/chat/completions`` endpoint, streamed (``stream: true``), greedy
(temperature 0, top-k 1), one request at a time, the servers interleaved prompt by prompt so that
a noisy machine slows every row alike. Each server answers one untimed warm-up request first.

Rows (``ROWS``): ``speculant`` (``speculant serve`` with its defaults: the fastest lossless setup
of this CPU), ``speculant-ar`` (the same server with plain decoding, the reference output of
speculant's rows), and llama-server's three configurations of the bench (``bench.llama_server``:
plain, its draft-model speculation, its n-gram speculation) on the same GGUF weights.

Measured per request, on the client side: time to first token (the first chunk with text), wall
time, completion tokens (the ``usage`` chunk the request asks for, else one per chunk), so tokens/s
includes prefill and request overhead, and decode tokens/s counts the tokens after the first over
the time after the first. Only the standard library talks HTTP here.

With ``concurrency`` levels above 1 (``--concurrency 1,2,4``), every server is started to decode
that many requests together (``speculant serve --max-batch N``, ``llama-server -np N`` with N times
the context), and at each level C every row is sent all the prompts by C clients at once (a new
request as soon as one ends), rows one after another: total tokens/s (all completion tokens over
the level's wall time) and per-request tokens/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SpeculantError
from ..output_paths import check_output_file
from ..specbench import load_questions
from .harness import git_info, machine_info, select
from .llama_server import LlamaServer, free_port, llama_server_unavailable

ROWS = ("speculant", "speculant-ar", "llama-server", "llama-server+draft", "llama-server+ngram")
_LLAMA_CONFIG = {"llama-server": "plain", "llama-server+draft": "draft", "llama-server+ngram": "ngram"}
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


@dataclass(frozen=True)
class ServeBenchConfig:
    rows: tuple[str, ...] = ROWS
    per_category: int = 1
    max_new_tokens: int = 128
    categories: tuple[str, ...] | None = None
    questions: str | None = None
    serve_args: tuple[str, ...] = ()  # extra ``speculant serve`` options for both speculant rows
    concurrency: tuple[int, ...] = (1,)  # clients at once (each level a separate measurement)
    startup_timeout: float = 1800.0  # a first start compiles kernels and measures the pass cost
    json_out: str | None = None

    def __post_init__(self):
        unknown = [r for r in self.rows if r not in ROWS]
        if unknown:
            raise ConfigError(f"unknown bench-serve row {', '.join(unknown)}: choose from {', '.join(ROWS)}")
        if not self.rows:
            raise ConfigError("bench-serve needs at least one row")
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise ConfigError("--per-category and --max-new-tokens must be >= 1")
        if not self.concurrency or any(c < 1 or c > 64 for c in self.concurrency):
            raise ConfigError(f"--concurrency takes levels from 1 to 64, got {list(self.concurrency)}")
        if self.questions is not None:
            load_questions(self.questions)  # a file that cannot be read fails before any server starts
        if self.json_out:
            check_output_file(self.json_out, "--json-out")


class SpeculantServer:
    """``speculant serve`` in a child process on a free loopback port (``method``: None for the
    default choice, else ``--method``)."""

    def __init__(self, method: str | None, extra_args: tuple[str, ...], startup_timeout: float):
        self.method, self.extra_args, self.startup_timeout = method, extra_args, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SpeculantServer":
        self.port = free_port()
        self._log = tempfile.TemporaryFile(prefix="speculant-serve-")
        cmd = [sys.executable, "-m", "speculant.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *(["--method", self.method] if self.method else []), *self.extra_args]
        env = {k: v for k, v in os.environ.items() if k != "SPECULANT_API_KEY"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:  # e.g. a bad --serve-args option: its own error line says why
                    last = next((x for x in reversed(self.log_tail().splitlines()) if x.strip()), "no output")
                    raise SpeculantError(f"`speculant {' '.join(cmd[3:])}` exited with status {self.proc.returncode}: "
                                         f"{last.strip()}")
                if _healthy(self.url):
                    return self
                time.sleep(1.0)
            raise RuntimeError(f"speculant serve did not become healthy in {self.startup_timeout:.0f} s:\n"
                               f"{self.log_tail()}")
        except BaseException:  # Ctrl-C while it starts included: no server is left running
            self.close()
            raise

    def log_tail(self, n: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-n:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def _healthy(url: str) -> bool:
    try:
        with _HTTP.open(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stream_chat(url: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """One streamed chat completion: its text, time to first token, wall time and completion tokens
    (from the usage chunk when the server sends one, else the number of text chunks)."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    text, chunks, usage, finish = [], 0, None, None
    t0 = time.perf_counter()
    ttft = None
    try:
        with _HTTP.open(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
                    if piece:
                        chunks += 1
                        text.append(piece)
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:2000]}") from e
    wall = time.perf_counter() - t0
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else chunks
    return {"text": "".join(text), "ttft_s": ttft if ttft is not None else wall, "wall_s": wall,
            "completion_tokens": tokens, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "finish_reason": finish, "tokens_from": "usage" if usage else "chunks"}


def request_body(row: str, question: str, max_new_tokens: int) -> dict[str, Any]:
    """The same greedy request for every row, with ``cache_prompt`` false, which both servers take:
    neither reuses an earlier request's prompt cache (every row pays its whole prefill)."""
    return {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": max_new_tokens,
            "temperature": 0.0, "top_k": 1, "stream": True, "stream_options": {"include_usage": True},
            "cache_prompt": False}


def _summary(runs: list[dict]) -> dict[str, Any]:
    wall = sum(r["wall_s"] for r in runs)
    tokens = sum(r["completion_tokens"] for r in runs)
    after = sum(r["wall_s"] - r["ttft_s"] for r in runs)
    return {"requests": len(runs), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else 0.0,
            "decode_tok_s": sum(r["completion_tokens"] - 1 for r in runs) / after if after > 0 else 0.0,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in runs)}


def _server(row: str, cfg: ServeBenchConfig):
    """Row ``row``'s server, not started yet."""
    slots = max(cfg.concurrency)
    if row in _LLAMA_CONFIG:
        return LlamaServer(_LLAMA_CONFIG[row], n_parallel=slots)
    args = ("--max-batch", str(slots), "--max-queue", str(max(16, 2 * slots)), *cfg.serve_args)
    return SpeculantServer("ar" if row == "speculant-ar" else None, args, cfg.startup_timeout)


def _concurrent(url: str, row: str, questions: list[dict], clients: int, max_new_tokens: int) -> dict[str, Any]:
    """Every question to ``url`` from ``clients`` clients at once (each takes the next question
    when its request ends): the runs, the wall time, and the throughput."""
    from concurrent.futures import ThreadPoolExecutor

    def one(q):
        r = stream_chat(url, request_body(row, q["turns"][0], max_new_tokens))
        r["question_id"] = q["question_id"]
        return r
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(one, questions))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in runs)
    return {"clients": clients, "requests": len(runs), "completion_tokens": tokens, "wall_s": wall,
            "total_tok_s": tokens / wall if wall > 0 else 0.0,
            "per_request_tok_s": statistics.mean(r["completion_tokens"] / r["wall_s"] for r in runs),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in runs), "runs": runs}


def run_serve_bench(cfg: ServeBenchConfig, command: str | None = None, log=print) -> dict[str, Any]:
    """Start every row's server, warm each up, then send every prompt to every server in turn."""
    rows, skipped = [], {}
    for row in cfg.rows:
        if row in _LLAMA_CONFIG and (why := llama_server_unavailable()) is not None:
            skipped[row] = why
        else:
            rows.append(row)
    for row, why in skipped.items():
        log(f"skipping {row}: {why}")
    questions = select(load_questions(cfg.questions), cfg.per_category, cfg.categories)
    servers: dict[str, Any] = {}
    try:
        for row in rows:
            log(f"starting {row} ...")
            servers[row] = _server(row, cfg)  # closed at the end even if it fails to start
            servers[row].start()
            stream_chat(servers[row].url, request_body(row, "Say hello.", 8))  # warm-up, untimed
        per_row: dict[str, list[dict]] = {row: [] for row in rows}
        levels: dict[int, dict[str, dict]] = {}
        for c in sorted(set(cfg.concurrency) - {1}):
            levels[c] = {}
            for row in rows:
                levels[c][row] = _concurrent(servers[row].url, row, questions, c, cfg.max_new_tokens)
                s = levels[c][row]
                log(f"{c} clients {row:>20}: {s['total_tok_s']:6.2f} tok/s in all, {s['per_request_tok_s']:6.2f} "
                    f"per request, first token {s['ttft_median_s'] * 1e3:7.0f} ms")
        for q in (questions if 1 in cfg.concurrency else []):
            for row in rows:
                r = stream_chat(servers[row].url, request_body(row, q["turns"][0], cfg.max_new_tokens))
                r["question_id"] = q["question_id"]
                per_row[row].append(r)
                log(f"{q['group']:>22} q{q['question_id']:<4} {row:>20}: {r['completion_tokens']:4d} tokens, "
                    f"first token {r['ttft_s'] * 1e3:7.0f} ms, {r['completion_tokens'] / r['wall_s']:6.2f} tok/s")
    finally:
        for server in servers.values():
            server.close()
    result = {"kind": "bench-serve", "date": time.strftime("%Y-%m-%d"), "command": command,
              "machine": machine_info(), "git": git_info(),
              "config": {"max_new_tokens": cfg.max_new_tokens, "per_category": cfg.per_category,
                         "serve_args": list(cfg.serve_args), "prompts": len(questions),
                         "concurrency": list(cfg.concurrency)},
              "skipped": skipped, "rows": {}}
    reference = {r["question_id"]: r["text"] for r in per_row.get("speculant-ar", [])}
    llama_plain = {r["question_id"]: r["text"] for r in per_row.get("llama-server", [])}
    for row, runs in per_row.items():
        if not runs:
            continue
        own_plain = llama_plain if row.startswith("llama-server") else reference
        same = sum(own_plain.get(r["question_id"]) == r["text"] for r in runs) if own_plain else None
        result["rows"][row] = {**_summary(runs), "same_as_plain": same, "runs": runs}
    if levels:
        result["concurrency"] = {}
        for c, by_row in levels.items():
            result["concurrency"][str(c)] = {}
            for row, s in by_row.items():
                own_plain = llama_plain if row.startswith("llama-server") else reference
                same = sum(own_plain.get(r["question_id"]) == r["text"] for r in s["runs"]) if own_plain else None
                result["concurrency"][str(c)][row] = {**s, "same_as_plain": same}
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of the rows: TTFT, tokens/s, decode tokens/s, ratio to the fastest llama-server
    row, and how many outputs equal that runtime's plain output."""
    lines = _single_table(result["rows"]) if result["rows"] else []
    if result.get("concurrency"):
        lines += ["", "| clients | server | tok/s in all | per request | first token (median ms) "
                      "| vs best llama-server | same as plain |", "|---|---|---|---|---|---|---|"]
        for c, by_row in result["concurrency"].items():
            peers = [s["total_tok_s"] for name, s in by_row.items() if name.startswith("llama-server")]
            best = max(peers) if peers else None
            for name, s in by_row.items():
                ratio = f"{s['total_tok_s'] / best:.2f}x" if best else "-"
                same = "-" if s["same_as_plain"] is None else f"{s['same_as_plain']}/{s['requests']}"
                lines.append(f"| {c} | {name} | {s['total_tok_s']:.2f} | {s['per_request_tok_s']:.2f} | "
                             f"{s['ttft_median_s'] * 1e3:.0f} | {ratio} | {same} |")
    return "\n".join(lines)


def _single_table(rows: dict[str, Any]) -> list[str]:
    peers = [s["tok_s"] for name, s in rows.items() if name.startswith("llama-server")]
    best = max(peers) if peers else None
    lines = ["| server | first token (median ms) | tok/s | decode tok/s | vs best llama-server | same as plain |",
             "|---|---|---|---|---|---|"]
    for name, s in rows.items():
        ratio = f"{s['tok_s'] / best:.2f}x" if best else "-"
        same = "-" if s["same_as_plain"] is None else f"{s['same_as_plain']}/{s['requests']}"
        lines.append(f"| {name} | {s['ttft_median_s'] * 1e3:.0f} | {s['tok_s']:.2f} | {s['decode_tok_s']:.2f} | "
                     f"{ratio} | {same} |")
    return lines
