"""``speculant bench --sessions FILE``: multi-turn sessions replayed against each server, one server at a time.

Every row is one server process on loopback: speculant's rows are ``speculant serve`` with that
``--method`` (``auto``: the server's own default choice) on the bench's ``--target`` (the default
model unless given), llama.cpp's rows ``llama-server`` in the configurations of the bench's peer
rows (``bench.llama_server``; ``llama-server+ngram-mod``: ``--spec-type ngram-mod``) on the same
GGUF. Each server is started, answers one untimed warm-up request, plays every session turn by turn
(``bench.sessions``: each turn a streamed ``/v1/chat/completions`` request with the whole history,
greedy, ``max_tokens`` = ``--max-new-tokens``), and is stopped before the next row starts: a
2-core machine runs one server at a time.

Prompt caches are on, as their users run them: ``speculant serve`` with its defaults, and
``llama-server`` with its own defaults (its host-memory prompt cache, ``--cache-ram`` 8192 MiB),
``--cache-reuse 256`` (reuse of matching chunks after a difference, as llama.cpp recommends for
editors) and ``cache_prompt: true`` in every request. A row may change that with options
(``NAME@KEY=VALUE``, :data:`ROW_OPTIONS`): ``@cache-ram=MB`` (both servers' ``--cache-ram``; 0 =
off) and ``@cache-reuse=N`` (llama-server's), e.g. ``auto,auto@cache-ram=0`` for speculant with and
without its prefix cache. ``cache_prompt`` is sent to llama-server only: ``speculant serve`` takes it
too, and true is its default.

Measured per turn, on the client's clock (seconds): ``ttft_s`` (sending the request to the first
chunk with content or a tool call), ``wall_s`` (to the end of the stream); and from the usage
chunk: ``completion_tokens`` (else one per content chunk: ``tokens_from``), ``prompt_tokens`` and
``cached_tokens`` (``usage.prompt_tokens_details.cached_tokens``, else llama-server's
``timings.cache_n``; None when the server reports neither: ``cached_from``). The summary and the
tables are ``bench.sessions_report``'s. A turn that fails (an HTTP error: the server's message is
kept) ends its session in that row; the comparison then leaves that session out of every row.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, SpeculantError
from ..output_paths import check_output_file
from ..provenance import git_info, machine_info, provenance, provenance_warning
from ..store.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from .llama_server import LlamaServer, llama_server_unavailable
from .methods import LLAMA_SERVER, OURS
from .serve_bench import SpeculantServer
from .sessions import Answer, Session, load_sessions, select_sessions, sessions_path, turn_messages

__all__ = ["DEFAULT_ROWS", "ROW_OPTIONS", "Row", "SessionsBenchConfig", "parse_row", "play_session",
           "run_sessions_bench", "stream_turn"]

DEFAULT_ROWS = ("auto", "ar", "llama-server", "llama-server+ngram-mod")
# key -> (who takes it, what it sets)
ROW_OPTIONS = {"cache-ram": ("both", "the server's --cache-ram MB (prompt cache in host memory; 0 = off)"),
               "cache-reuse": ("llama-server", "llama-server's --cache-reuse N (0 = off)")}
LLAMA_CACHE_REUSE = 256  # llama-server's --cache-reuse unless a row says otherwise
LLAMA_N_CTX = 8192  # llama-server's context: the longest shipped session needs about 4,000 tokens
WARMUP = "Say hello."
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


@dataclass(frozen=True)
class Row:
    """One row of ``--methods``: ``text`` as written, the method or peer ``name``, its options."""

    text: str
    name: str
    options: tuple[tuple[str, int], ...] = ()

    @property
    def peer(self) -> bool:
        return self.name in LLAMA_SERVER

    def option(self, key: str) -> int | None:
        return dict(self.options).get(key)


def parse_row(text: str) -> Row:
    """``NAME[@KEY=VALUE]...``: NAME one of speculant's methods or a llama-server row."""
    name, *opts = text.strip().split("@")
    if name not in OURS and name not in LLAMA_SERVER:
        peers = ", ".join(LLAMA_SERVER)
        hint = " (not a server: bench --sessions runs servers)" if name in ("hf-assisted", "openvino",
                                                                            "openvino+lookup", "openvino+draft") else ""
        raise ConfigError(f"--methods: {name!r} is not a row of bench --sessions{hint}; use speculant's methods "
                          f"({', '.join(OURS)}) or {peers}")
    options: dict[str, int] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in ROW_OPTIONS:
            raise ConfigError(f"--methods {text}: unknown option @{key}; bench --sessions takes "
                              + "; ".join(f"@{k}=N ({what})" for k, (_, what) in ROW_OPTIONS.items()))
        if ROW_OPTIONS[key][0] == "llama-server" and name not in LLAMA_SERVER:
            raise ConfigError(f"--methods {text}: @{key} is an option of the llama-server rows only")
        if not eq or not value.isdigit():
            raise ConfigError(f"--methods {text}: @{key} takes a whole number >= 0, e.g. @{key}=0")
        options[key] = int(value)
    return Row(text.strip(), name, tuple(sorted(options.items())))


@dataclass(frozen=True)
class SessionsBenchConfig:
    """What ``bench --sessions`` runs. ``sessions``: a file or ``default``; ``rows``: ``--methods``;
    ``serve_args``: more ``speculant serve`` options for speculant's rows (the bench's decoding
    flags); timeouts in seconds."""

    sessions: str = "default"
    rows: tuple[str, ...] = DEFAULT_ROWS
    max_new_tokens: int = 128
    kinds: tuple[str, ...] | None = None
    limit: int | None = None
    target: str = DEFAULT_TARGET
    draft: str | None = DEFAULT_DRAFT  # sd / mcsd and llama-server+draft; None: those rows are skipped
    serve_args: tuple[str, ...] = ()
    startup_timeout: float = 1800.0  # a first start compiles kernels and measures the pass cost
    request_timeout: float = 3600.0
    json_out: str | None = None

    def __post_init__(self):
        if not self.rows:
            raise ConfigError("--methods names no row")
        parsed = [parse_row(r) for r in self.rows]
        texts = [r.text for r in parsed]
        if len(set(texts)) != len(texts):
            raise ConfigError(f"--methods lists a row twice: {','.join(texts)}")
        if not 1 <= self.max_new_tokens <= 1 << 20:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        self.selected()  # a file that does not load, or a selection that picks nothing, fails before any server
        if self.json_out:
            check_output_file(self.json_out, "--json-out")

    def parsed_rows(self) -> list[Row]:
        return [parse_row(r) for r in self.rows]

    def selected(self) -> list[Session]:
        return select_sessions(load_sessions(self.sessions), self.kinds, self.limit)


# ---------------------------------------------------------------------------------------------
# one turn
# ---------------------------------------------------------------------------------------------

def request_body(row: Row, session: Session, answers: list[Answer], max_tokens: int) -> dict[str, Any]:
    """Turn ``len(answers)`` of ``session`` as a streamed greedy chat request for ``row``'s server."""
    body: dict[str, Any] = {"model": "default", "messages": turn_messages(session, answers), "max_tokens": max_tokens,
                            "temperature": 0.0, "top_k": 1, "stream": True, "stream_options": {"include_usage": True}}
    if session.tools:
        body["tools"] = list(session.tools)
    if row.peer:
        body["cache_prompt"] = True  # llama-server's default, said explicitly
    return body


def stream_turn(url: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Send one streamed chat request; its answer and timings (see the module docstring)."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    text, calls, chunks = [], {}, 0
    usage = timings = finish = ttft = None
    t0 = time.perf_counter()
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
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    finish = choice.get("finish_reason") or finish
                    piece = delta.get("content") or ""
                    if piece:
                        chunks += 1
                        text.append(piece)
                    for c in delta.get("tool_calls") or []:
                        _add_call(calls, c)
                    if ttft is None and (piece or delta.get("tool_calls") or delta.get("reasoning_content")):
                        ttft = time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raise SpeculantError(f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:2000]}") from None
    wall = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        cached, cached_from = details["cached_tokens"], "usage"
    elif isinstance((timings or {}).get("cache_n"), int):
        cached, cached_from = timings["cache_n"], "timings"
    else:
        cached, cached_from = None, None
    tokens = (usage or {}).get("completion_tokens")
    return {"text": "".join(text), "tool_calls": [calls[i] for i in sorted(calls)],
            "ttft_s": ttft if ttft is not None else wall, "wall_s": wall,
            "completion_tokens": int(tokens) if isinstance(tokens, int) else chunks,
            "tokens_from": "usage" if isinstance(tokens, int) else "chunks",
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached, "cached_from": cached_from,
            "finish_reason": finish}


def _add_call(calls: dict[int, dict], delta: dict) -> None:
    """Add one streamed ``tool_calls`` delta to the call at its index (the first has id and name)."""
    i = int(delta.get("index", 0))
    call = calls.setdefault(i, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"] or f"call_{i}"
    fn = delta.get("function") or {}
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def play_session(url: str, row: Row, session: Session, max_tokens: int, timeout: float = 3600.0,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every turn of ``session`` in order, each with the history so far and the server's own
    answers: ``{"id", "kind", "turns": [per-turn records], "error": None | str}``."""
    answers: list[Answer] = []
    turns: list[dict] = []
    for k in range(len(session.turns)):
        body = request_body(row, session, answers, max_tokens)
        try:
            r = stream_turn(url, body, timeout)
        except (SpeculantError, OSError, ValueError) as e:  # HTTP errors, a dead server, a broken stream
            why = f"turn {k + 1}: {e}"
            log(f"{row.text} {session.id} {why}")
            return {"id": session.id, "kind": session.kind, "turns": turns, "error": why}
        r = {"turn": k + 1, "messages": len(body["messages"]), **r}
        turns.append(r)
        answers.append(Answer(r["text"], tuple(r["tool_calls"])))
        cached = ("" if r["cached_tokens"] is None
                  else f", {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens cached")
        log(f"{row.text:>24} {session.id:<18} turn {k + 1}: {r['completion_tokens']:4d} tokens, first token "
            f"{r['ttft_s'] * 1e3:7.0f} ms, {r['completion_tokens'] / max(r['wall_s'], 1e-9):6.2f} tok/s{cached}")
    return {"id": session.id, "kind": session.kind, "turns": turns, "error": None}


# ---------------------------------------------------------------------------------------------
# the servers
# ---------------------------------------------------------------------------------------------

def _unavailable(row: Row, cfg: SessionsBenchConfig) -> str | None:
    if row.peer:
        return llama_server_unavailable()
    if row.name in ("sd", "mcsd") and cfg.draft is None:
        return f"{row.name} needs a draft model: give --draft"
    return None


def _server(row: Row, cfg: SessionsBenchConfig):
    """Row ``row``'s server, not started, and its command line (the port filled in at start)."""
    if row.peer:
        reuse = row.option("cache-reuse")
        reuse = LLAMA_CACHE_REUSE if reuse is None else reuse
        return LlamaServer(LLAMA_SERVER[row.name], target=cfg.target, draft=cfg.draft or DEFAULT_DRAFT,
                           n_ctx=LLAMA_N_CTX, cache_ram=row.option("cache-ram"), startup_timeout=cfg.startup_timeout,
                           extra_args=("--cache-reuse", str(reuse)) if reuse else ())
    args = ["--target", cfg.target]
    if row.name in ("sd", "mcsd"):
        args += ["--draft", str(cfg.draft)]
    if row.option("cache-ram") is not None:
        args += ["--cache-ram", str(row.option("cache-ram"))]
    return SpeculantServer(None if row.name == "auto" else row.name, (*args, *cfg.serve_args), cfg.startup_timeout)


def _command(server) -> list[str]:
    if isinstance(server, LlamaServer):
        return server.args(server.port)
    return ["speculant", "serve", "--host", "127.0.0.1", "--port", str(server.port),
            *(["--method", server.method] if server.method else []), *server.extra_args]


def cpu_identity() -> dict[str, Any]:
    """``lscpu``'s vendor, model name, family, model and stepping (``/proc/cpuinfo``'s where lscpu
    is missing); the ISA flags that matter are ``machine_info``'s."""
    keys = {"Vendor ID": "vendor", "Model name": "model_name", "CPU family": "family", "Model": "model",
            "Stepping": "stepping"}
    out: dict[str, Any] = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, env={"LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    proc = {"vendor_id": "Vendor ID", "model name": "Model name", "cpu family": "CPU family", "model": "Model",
            "stepping": "Stepping"}
    if not text:
        try:
            lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            text = "\n".join(f"{proc[k.strip()]}: {v}" for k, _, v in (ln.partition(":") for ln in lines)
                             if k.strip() in proc)
        except OSError:
            pass
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys and keys[key.strip()] not in out:
            out[keys[key.strip()]] = value.strip()
    return out


def run_sessions_bench(cfg: SessionsBenchConfig, command: str | None = None,
                       log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Play the sessions against every row's server in turn; the result (and ``cfg.json_out``)."""
    from .sessions_report import summarize

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    sessions = cfg.selected()
    source_at_start = git_info()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    skipped, failed, rows = {}, {}, {}
    for row in cfg.parsed_rows():
        if (why := _unavailable(row, cfg)) is not None:
            skipped[row.text] = why
            log(f"skipping {row.text}: {why}")
            continue
        try:
            server = _server(row, cfg)
        except ConfigError as e:  # e.g. a target without a GGUF file for llama-server
            skipped[row.text] = str(e)
            log(f"skipping {row.text}: {e}")
            continue
        try:
            log(f"starting {row.text} ...")
            t0 = time.perf_counter()
            try:
                server.start()
                stream_turn(server.url, {"model": "default", "messages": [{"role": "user", "content": WARMUP}],
                                         "max_tokens": 8, "temperature": 0.0, "stream": True}, cfg.request_timeout)
            except (SpeculantError, RuntimeError, OSError, ValueError) as e:
                failed[row.text] = f"the server did not start or answer its warm-up request: {e}"
                log(f"{row.text}: {failed[row.text]}")
                continue
            started = time.perf_counter() - t0
            played = [play_session(server.url, row, s, cfg.max_new_tokens, cfg.request_timeout, log) for s in sessions]
            rows[row.text] = {"server": _command(server), "startup_s": started, "sessions": played}
        finally:
            server.close()
    source = provenance(source_at_start, git_info())
    if (why := provenance_warning(source)) is not None:
        log(f"warning: {why}")
    path = sessions_path(cfg.sessions)
    result = {"kind": "bench-sessions", "command": command, "date": date,
              "machine": {**machine_info(), **cpu_identity()}, **source,
              "config": {"sessions": cfg.sessions, "max_new_tokens": cfg.max_new_tokens, "target": cfg.target,
                         "draft": cfg.draft, "rows": list(cfg.rows), "kinds": list(cfg.kinds) if cfg.kinds else None,
                         "limit": cfg.limit, "serve_args": list(cfg.serve_args)},
              "sessions_file": {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                "sessions": [{"id": s.id, "kind": s.kind, "turns": len(s.turns)} for s in sessions]},
              "skipped": skipped, "failed": failed, "rows": rows}
    result["summary"] = summarize(result)
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return result
