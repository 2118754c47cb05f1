"""The OpenVINO GenAI peer rows of the bench: Intel's runtime on the same weights and prompt ids.

OpenVINO GenAI is a benchmark extra (``make install-openvino``), never a test dependency. Its
packages pull transformers 5.5.x, which conflicts with the project's own, so they live in a virtual
environment of their own (``$SPECULANT_CACHE/peers/openvino-venv``) and this module drives them
through a subprocess, ``openvino_worker.py`` run with that venv's interpreter (JSON lines over
stdin/stdout). The models are the bench's own weights: the project's bf16 safetensors cache of
each Qwen preset (or of any other model, ``tools/install_openvino.py --model SPEC``), exported once
by ``optimum-cli export openvino --weight-format int4`` to
``$SPECULANT_CACHE/peers/openvino-ir/<name>-int4`` (:func:`ir_dir`; command and versions in
``speculant_export.json`` there).

Configurations, each OpenVINO's best of its kind on CPU:

* ``plain``: ``LLMPipeline(ir, "CPU")``, greedy;
* ``lookup``: ``prompt_lookup=True`` with 3 candidate tokens and n-grams up to 3;
* ``draft``: ``draft_model=`` the draft's int4 IR (the 0.5B preset's by default), 3 assistant tokens.

Every run is fed the same prompt token ids as the other rows (an ``openvino.Tensor``, no
tokenizer or chat template on OpenVINO's side), decodes greedily until EOS (kept in the output,
as in speculant's) or ``max_new_tokens``, and pays its own prefill. ``exact=True`` forces f32
compute, an f32 KV cache and no dynamic int8 quantization of activations; OpenVINO's defaults on
a CPU with bf16 support are bf16 / u8 / int8 (group 32), under which its speculative modes can
change the greedy output.

OpenVINO's pipeline keeps the KV cache of its previous request and reuses the prefix a new prompt
shares with it (measured here: a repeated prompt's prefill 0.13-0.15 s against 0.44-0.49 s for a
prompt of the same length without a common prefix; any two chat prompts share the template's
system turn). Every row of the bench pays its whole prefill, so ``fresh_prefill`` (the default)
sends an untimed one-token request with a one-token prompt before each ``run``: the next prompt
then shares no prefix with what the pipeline holds (and its output cannot depend on the order of
requests).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

import torch

from ..errors import ConfigError, SpeculantError
from ..store.models import cache_dir
from ..store.presets import PRESETS

CONFIGS = ("plain", "lookup", "draft")
TARGET_PRESET = "qwen2.5-coder-1.5b-instruct"
DRAFT_PRESET = "qwen2.5-coder-0.5b-instruct"
VENV_MARKER = "speculant-openvino.json"  # written last by tools/install_openvino.py
WORKER = Path(__file__).with_name("openvino_worker.py")
_INSTALL = "run `make install-openvino` (its own venv and int4 IR of both Qwen presets, ~5 min)"


class OpenVINOError(SpeculantError):
    """The OpenVINO worker failed to start, died, timed out, or rejected a request."""


def peers_dir() -> Path:
    return cache_dir() / "peers"


def venv_dir() -> Path:
    return peers_dir() / "openvino-venv"


def ir_dir(spec: str | os.PathLike) -> Path:
    """Where the int4 OpenVINO IR of model ``spec`` is exported: ``<preset>-int4`` for a preset
    (``make install-openvino``), else ``<name>-<key>-int4``, the key a hash of the absolute path
    (and of a file's size and mtime: a changed .gguf needs a new export)."""
    name = str(spec)
    if name not in PRESETS:
        path = Path(spec).expanduser().resolve()
        key = str(path)
        if path.is_file():
            st = path.stat()
            key += f"|{st.st_size}|{st.st_mtime_ns}"
        name = f"{path.stem if path.is_file() else path.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return peers_dir() / "openvino-ir" / f"{name}-int4"


def export_hint(spec: str | os.PathLike) -> str:
    """The command that exports ``spec``'s IR."""
    if str(spec) in (TARGET_PRESET, DRAFT_PRESET):
        return _INSTALL
    return f"export it once with `python tools/install_openvino.py --model {spec}` (int4, in OpenVINO's venv)"


def missing_ir(spec: str | os.PathLike) -> str | None:
    """Why there is no IR of ``spec`` to run (with the command that exports it), or None."""
    where = ir_dir(spec)
    return None if (where / "openvino_model.xml").is_file() else \
        f"no OpenVINO IR of {spec} at {where}; {export_hint(spec)}"


def openvino_python() -> Path | None:
    """The OpenVINO venv's interpreter, or None if the venv is missing or incompletely installed."""
    py = venv_dir() / "bin" / "python"
    return py if py.exists() and (venv_dir() / VENV_MARKER).is_file() else None


def openvino_unavailable(draft: bool = True, target: str | os.PathLike = TARGET_PRESET,
                         draft_model: str | os.PathLike = DRAFT_PRESET) -> str | None:
    """None when the venv and the IR of ``target`` (and of ``draft_model``, if ``draft``) are in
    place, else why (with the command that fixes it)."""
    if openvino_python() is None:
        return f"no OpenVINO venv at {venv_dir()}; {_INSTALL}"
    for spec in (target, draft_model) if draft else (target,):
        if why := missing_ir(spec):
            return why
    return None


def default_threads() -> int:
    """The threads speculant itself runs with, so both runtimes get the same cores."""
    return torch.get_num_threads() or os.cpu_count() or 1


class OpenVINOPeer:
    """One OpenVINO GenAI pipeline in a worker process.

    ``run(ids, n) -> (token ids, wall seconds, {"prefill_s", "decode_s", ...})``; the wall time
    is measured around ``LLMPipeline.generate`` in the worker (the JSON round trip, well under a
    millisecond, is in ``timing["ipc_wall_s"]`` instead). Use as a context manager, or ``close()``.
    ``target`` / ``draft``: IR directories (default: the Qwen presets'); ``self.target`` /
    ``self.draft`` are the ones it runs (``self.draft`` None unless ``config == "draft"``).
    """

    def __init__(self, config: str = "plain", threads: int | None = None, *, exact: bool = False,
                 eos_token_ids=None, target: str | os.PathLike | None = None,
                 draft: str | os.PathLike | None = None, num_assistant_tokens: int = 3,
                 max_ngram_size: int = 3, timeout_s: float = 600.0, fresh_prefill: bool = True):
        if config not in CONFIGS:
            raise ConfigError(f"unknown OpenVINO configuration {config!r}; choose one of {', '.join(CONFIGS)}")
        if target is None and (why := openvino_unavailable(draft=config == "draft" and draft is None)):
            raise ConfigError(why)
        py = openvino_python()
        if py is None:
            raise ConfigError(f"no OpenVINO venv at {venv_dir()}; {_INSTALL}")
        self.config, self.exact = config, exact
        self.threads = threads or default_threads()
        self.timeout_s = timeout_s
        self.fresh_prefill = fresh_prefill
        self.target = Path(target) if target is not None else ir_dir(TARGET_PRESET)  # IR directories
        self.draft = (Path(draft) if draft is not None else ir_dir(DRAFT_PRESET)) if config == "draft" else None
        cmd = [str(py), "-I", str(WORKER), "--target", str(self.target), "--config", config,
               "--threads", str(self.threads), "--num-assistant-tokens", str(num_assistant_tokens),
               "--max-ngram-size", str(max_ngram_size)]
        if self.draft is not None:
            cmd += ["--draft", str(self.draft)]
        if exact:
            cmd.append("--exact")
        if eos_token_ids:
            cmd += ["--eos", *(str(int(e)) for e in sorted(set(eos_token_ids)))]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._stderr = collections.deque(maxlen=60)
        self._lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put, True), daemon=True).start()
        self._err_pump = threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append, False),
                                          daemon=True)
        self._err_pump.start()
        try:
            self.info = self._receive()
        except BaseException:
            self.close()
            raise
        if "error" in self.info:
            msg = self.info["error"]
            self.close()
            raise OpenVINOError(f"OpenVINO worker ({config}) {msg}{self._stderr_tail()}")

    @staticmethod
    def _pump(stream, sink, eof_marker: bool) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        if eof_marker:
            sink(None)  # end of stdout: the worker exited

    def _stderr_tail(self, n: int = 25) -> str:
        if self.proc.poll() is not None:
            self._err_pump.join(timeout=5)  # the worker exited: read the rest of what it wrote
        tail = list(self._stderr)[-n:]
        return ("\nworker stderr (last lines):\n" + "\n".join(tail)) if tail else ""

    def _receive(self) -> dict:
        while True:
            try:
                line = self._lines.get(timeout=self.timeout_s)
            except queue.Empty:
                raise OpenVINOError(f"OpenVINO worker ({self.config}) gave no answer in {self.timeout_s:.0f} s"
                                    + self._stderr_tail()) from None
            if line is None:
                rc = self.proc.wait(timeout=10)
                raise OpenVINOError(f"OpenVINO worker ({self.config}) exited with status {rc}" + self._stderr_tail())
            try:
                return json.loads(line)
            except ValueError:
                self._stderr.append(f"[stdout] {line}")  # not protocol: keep it for diagnostics

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float, dict]:
        if self.proc.poll() is not None:
            raise OpenVINOError(f"OpenVINO worker ({self.config}) is not running (status {self.proc.returncode})"
                                + self._stderr_tail())
        ids = torch.as_tensor(ids)
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ConfigError(f"OpenVINOPeer.run takes one prompt (shape [n] or [1, n]), got {tuple(ids.shape)}")
        flat = [int(i) for i in ids.reshape(-1).tolist()]
        if self.fresh_prefill and flat:  # untimed: leave no prefix of this prompt in the pipeline's KV cache
            self._request([1 if flat[0] == 0 else 0], 1)
        t = time.perf_counter()
        rep = self._request(flat, max_new_tokens)
        outer = time.perf_counter() - t
        timing = {"prefill_s": rep["prefill_s"], "decode_s": rep["decode_s"],
                  "ipc_wall_s": max(outer - rep["wall_s"], 0.0), "finish": rep.get("finish"),
                  **rep.get("stats", {})}
        return rep["ids"], rep["wall_s"], timing

    def _request(self, flat: list[int], max_new_tokens: int) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"ids": flat, "max_new_tokens": int(max_new_tokens)}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise OpenVINOError(f"OpenVINO worker ({self.config}) is gone ({e})" + self._stderr_tail()) from None
        rep = self._receive()
        if "error" in rep:
            raise OpenVINOError(f"OpenVINO ({self.config}) failed: {rep['error']}" + self._stderr_tail())
        return rep

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.close()  # end of input: the worker exits
            proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - stuck or already broken: stop it
            proc.kill()
            proc.wait()

    def __enter__(self) -> "OpenVINOPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

