"""The llama-server peer rows of the bench: llama.cpp's own server, in its best configurations.

llama.cpp's ``llama-server`` is what a CPU user would otherwise run, and it has speculative
decoding of its own. Five configurations (``CONFIGS``), each one server process:

- ``plain``: plain greedy decoding;
- ``draft``: ``--spec-type draft-simple -md DRAFT.gguf --spec-draft-n-max 3`` (draft model: the
  bench's draft's GGUF, by default the 0.5B Qwen preset's; 3 drafted tokens was its fastest
  setting here, see MODELS.md);
- ``ngram``: ``--spec-type ngram-simple`` (n-gram lookup in the context, no draft model);
- ``ngram-mod``: ``--spec-type ngram-mod`` (llama.cpp's n-gram lookup over a rolling hash of the
  context; 12% faster than ``ngram-simple`` on code editing here);
- ``ngram-map-k``: ``--spec-type ngram-map-k`` (n-gram lookup keyed on the last k tokens, with
  counts of what followed them).

The binary is built from the llama.cpp vendored in llama-cpp-python 0.3.36 by
``make install-llama-server`` (``tools/build_llama_server.sh``) into
``$SPECULANT_CACHE/peers/llama.cpp-0.3.36/bin`` (next to its shared libraries); it is a benchmark
extra, never a dependency: when it is missing the bench skips these rows and says how to build it.

Every row is fed the same prompt token ids (``/completion`` with ``prompt`` = a list of ids, so the
server does not tokenize) and the same target weights (``store.models.gguf_path``: the preset's GGUF,
checked against its SHA-256). Decoding is greedy (temperature 0, top-k 1, no penalties), stops at
EOS or ``max_new_tokens``, and re-computes the prompt on every request (``cache_prompt: false``,
no host prompt cache): the wall time includes prefill, like the other rows. Only the standard
library talks HTTP. ``speculant bench --target X --draft Y`` runs X's and Y's GGUF files
(``bench.pair.plan_peers``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..store.models import cache_dir, gguf_path

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is built
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
DRAFT_N_MAX = 3
CONFIGS = ("plain", "draft", "ngram", "ngram-mod", "ngram-map-k")
# the server is local: never route its requests through an http_proxy from the environment
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
INSTALL_HINT = ("build it with `make install-llama-server` (llama.cpp from llama-cpp-python "
                f"{LLAMA_CPP_VERSION}'s sdist, about 8 min on 2 cores)")


def llama_server_dir() -> Path:
    """Where ``make install-llama-server`` puts the build: ``<cache>/peers/llama.cpp-VERSION``."""
    return cache_dir() / "peers" / f"llama.cpp-{LLAMA_CPP_VERSION}"


def llama_server_binary() -> Path | None:
    """The installed ``llama-server`` executable, or None."""
    path = llama_server_dir() / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def llama_server_unavailable() -> str | None:
    """None when llama-server is installed, else the reason (with the fix)."""
    if llama_server_binary() is None:
        return f"llama-server is not installed in {llama_server_dir() / 'bin'}; {INSTALL_HINT}"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process serving the target in one configuration.

    ``run(ids, max_new_tokens) -> (token ids, wall seconds, timing)``; the server starts on the
    first ``run`` (or ``start()``) and stops on ``close()``, at exit from a ``with`` block, or when
    the object is collected. ``timing`` has ``prefill_s`` and ``decode_s`` as the server measured
    them, ``prompt_n`` / ``predicted_n``, and for the speculative configurations ``draft_n`` /
    ``draft_n_accepted`` (drafted and accepted tokens) when the server reports them.
    """

    def __init__(self, config: str = "plain", target: str | os.PathLike = TARGET,
                 draft: str | os.PathLike = DRAFT, n_threads: int | None = None, n_ctx: int = 4096,
                 startup_timeout: float = 180.0, extra_args: tuple[str, ...] = (), n_parallel: int = 1,
                 cache_ram: int | None = 0):
        if config not in CONFIGS:
            raise ConfigError(f"unknown llama-server configuration {config!r}; use one of "
                              f"{', '.join(CONFIGS)}")
        if (why := llama_server_unavailable()) is not None:
            raise ConfigError(why)
        self.config = config
        self.binary = llama_server_binary()
        self.target = self._gguf(target, "target")
        self.draft = self._gguf(draft, "draft") if config == "draft" else None
        self.n_threads = n_threads or torch.get_num_threads() or os.cpu_count() or 1
        self.n_ctx = n_ctx
        self.n_parallel = n_parallel  # slots decoding together (-np); each gets n_ctx tokens of context
        # MiB of host memory for llama-server's prompt cache (--cache-ram); 0: none (every request pays its
        # prefill: the bench's default), None: the server's own default (bench --sessions: as its users run it)
        self.cache_ram = cache_ram
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    @staticmethod
    def _gguf(spec: str | os.PathLike, role: str) -> Path:
        path = gguf_path(spec)
        if path is None:
            raise ConfigError(f"no GGUF file behind the {role} {spec!r}: llama-server needs a preset, "
                              "a .gguf file, or a speculant cache directory converted from one")
        return path

    # ---------------------------------------------------------------------------------------
    # process
    # ---------------------------------------------------------------------------------------

    def args(self, port: int) -> list[str]:
        """The server's command line for this configuration."""
        t = str(self.n_threads)
        args = [str(self.binary), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(port),
                "-t", t, "-tb", t, "-c", str(self.n_ctx * self.n_parallel), "-np", str(self.n_parallel),
                *(("--cache-ram", str(self.cache_ram)) if self.cache_ram is not None else ()),
                "--no-webui", "-lv", "2"]  # warnings and errors only
        if self.config == "draft":
            args += ["--spec-type", "draft-simple", "-md", str(self.draft),
                     "--spec-draft-n-max", str(DRAFT_N_MAX), "-td", t]
        elif self.config == "ngram":
            args += ["--spec-type", "ngram-simple"]
        elif self.config in ("ngram-mod", "ngram-map-k"):
            args += ["--spec-type", self.config]
        return args + list(self.extra_args)

    def start(self) -> "LlamaServer":
        """Start the server (no-op if running) and wait until ``/health`` answers OK."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        env = dict(os.environ)
        bindir = str(self.binary.parent)
        env["LD_LIBRARY_PATH"] = bindir + (os.pathsep + env["LD_LIBRARY_PATH"]
                                           if env.get("LD_LIBRARY_PATH") else "")
        for attempt in range(3):  # the free port may be taken between probe and bind: retry
            self._close_log()
            # a file, not a pipe: nobody reads the server's output while it runs, and a full
            # pipe would block it
            self._log = tempfile.TemporaryFile(prefix=f"llama-server-{self.config}-")
            self.port = free_port()
            self.proc = subprocess.Popen(self.args(self.port), stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env)
            if self._wait_healthy():
                return self
            tail = self.log_tail()
            self._stop_process()
            if "bind" not in tail.lower() or attempt == 2:
                raise RuntimeError(
                    f"llama-server ({self.config}) did not become healthy within "
                    f"{self.startup_timeout:.0f} s; command: {' '.join(self.args(self.port))}\n"
                    f"--- its output (tail) ---\n{tail}")
        raise AssertionError("unreachable")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with _HTTP.open(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200 and json.loads(r.read() or b"{}").get("status") == "ok":
                        return True
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass  # not listening yet (refused) or still loading the model (503)
            time.sleep(0.2)
        return False

    def log_tail(self, n_chars: int = 3000) -> str:
        """The last ``n_chars`` of the server's output (stdout and stderr)."""
        if self._log is None:
            return ""
        try:
            self._log.flush()
            size = self._log.seek(0, os.SEEK_END)
            self._log.seek(max(0, size - n_chars))
            return self._log.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _stop_process(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def _close_log(self) -> None:
        if self._log is not None:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None

    def close(self) -> None:
        """Stop the server (terminate, then kill after 10 s)."""
        self._stop_process()
        self._close_log()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- __del__ must not raise (also at interpreter shutdown)
            pass

    # ---------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float, dict[str, Any]]:
        """Greedy continuation of the prompt ``ids`` (1-D token ids) until EOS or ``max_new_tokens``.

        Returns the generated token ids (the server lists the end-of-generation token it stopped
        at, like the other bench rows), the request's wall time in seconds (prefill included), and
        the server's own timing (see the class docstring)."""
        self.start()
        prompt = [int(t) for t in ids.reshape(-1).tolist()]
        body = {
            "prompt": prompt, "n_predict": int(max_new_tokens), "stream": False,
            "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "cache_prompt": False, "return_tokens": True,
        }
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/completion", data=data,
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        try:
            with _HTTP.open(req, timeout=3600) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:2000]
            raise RuntimeError(f"llama-server ({self.config}) answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError) as e:
            raise RuntimeError(f"llama-server ({self.config}) failed: {e}\n--- its output (tail) ---\n"
                               f"{self.log_tail()}") from e
        wall = time.perf_counter() - t
        res = json.loads(raw)
        tokens = [int(x) for x in res.get("tokens") or []]
        timings = res.get("timings") or {}
        timing: dict[str, Any] = {
            "prefill_s": float(timings.get("prompt_ms", 0.0)) / 1e3,
            "decode_s": float(timings.get("predicted_ms", 0.0)) / 1e3,
            "prompt_n": timings.get("prompt_n"),
            "predicted_n": timings.get("predicted_n"),
            "stop_type": res.get("stop_type"),
        }
        for key in ("draft_n", "draft_n_accepted"):
            if key in timings:
                timing[key] = int(timings[key])
        return tokens[:max_new_tokens], wall, timing
