"""What one verification pass of the target costs on this machine, by the number of rows it scores.

The right size of a draft tree depends on the hardware, not only on the heads. Qwen2.5-1.5B in
bf16, 2 cores, 500 tokens of context, milliseconds per pass:

    rows                                     1     8    16    29    32
    Intel Xeon, AMX (speculant's kernel)   138     -   155   172   174    weight-bound: 29 rows 1.25x
    AMD EPYC, AVX-512 BF16 (oneDNN)        156   167   232   320   372    compute-bound past ~8 rows

A 16-row tree costs 1.12x a token on the first machine and 1.49x on the second, so a tree size
tuned on one is wrong on the other. :func:`pass_cost` measures the curve once per machine, model,
dtype and runtime (a few seconds), caches it under ``$SPECULANT_CACHE``, and the dynamic tree
(``drafters.medusa``) sizes every step's tree against it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .tree import chain

__all__ = ["PassCost", "measure_pass_cost", "pass_cost", "machine_key"]

WIDTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32)
CACHE_VERSION = 1


@dataclass(frozen=True)
class PassCost:
    """Milliseconds of one target pass scoring ``rows[i]`` rows: ``ms[i]``. Rows ascend from 1;
    ``ms`` never decreases (a measured curve is made so with a running maximum: a wider pass is
    never cheaper, whatever the noise said)."""

    rows: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        rows, ms = tuple(int(r) for r in self.rows), tuple(float(m) for m in self.ms)
        if not rows or len(rows) != len(ms):
            raise ConfigError(f"a pass-cost curve needs as many times as widths, got {len(rows)} widths and "
                              f"{len(ms)} times")
        if rows[0] != 1 or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ConfigError(f"pass-cost widths must start at 1 and increase, got {list(rows)}")
        if any(not (m > 0) for m in ms) or any(b < a for a, b in zip(ms, ms[1:])):
            raise ConfigError(f"pass-cost times must be positive and non-decreasing, got {list(ms)}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "ms", ms)

    @classmethod
    def monotone(cls, rows, ms) -> "PassCost":
        """The curve through measured (noisy) points, with a running maximum over the times."""
        out, top = [], 0.0
        for m in ms:
            top = max(top, float(m))
            out.append(top)
        return cls(tuple(rows), tuple(out))

    def __call__(self, n: int) -> float:
        """Milliseconds for ``n >= 1`` rows: linear between measured widths, and past the widest
        along the last segment's slope."""
        if n < 1:
            raise ValueError(f"a pass scores at least one row, got {n}")
        rows, ms = self.rows, self.ms
        if len(rows) == 1:
            return ms[0]
        for i in range(1, len(rows)):
            if n <= rows[i] or i == len(rows) - 1:
                a, b = rows[i - 1], rows[i]
                return ms[i - 1] + (ms[i] - ms[i - 1]) * (n - a) / (b - a)
        raise AssertionError("unreachable")

    def relative(self) -> dict[int, float]:
        """Each measured width's cost over one row's: {rows: ratio}."""
        return {r: m / self.ms[0] for r, m in zip(self.rows, self.ms)}

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "ms": [round(m, 3) for m in self.ms]}


@torch.inference_mode()
def measure_pass_cost(backend, widths=WIDTHS, context: int = 128, reps: int = 2, seed: int = 0) -> PassCost:
    """Time ``backend.forward`` on tree passes of each width after ``context`` cached tokens.

    Widths are taken round-robin ``reps`` times (so drift over the run touches every width alike)
    after one untimed pass each; the median of each width's times counts. The cache is rolled back
    after every pass and reset at the end. Passes ask for every row's logits and hidden state, as a
    heads method's verification does."""
    widths = sorted(set(int(w) for w in widths))
    if not widths or widths[0] != 1:
        raise ConfigError(f"pass-cost widths must include 1 (plain decoding), got {widths}")
    if context < 1 or reps < 1:
        raise ConfigError(f"context and reps must be >= 1, got {context} and {reps}")
    gen = torch.Generator().manual_seed(seed)
    vocab = int(backend.vocab_size)
    backend.reset()
    backend.forward(torch.randint(0, vocab, (context,), generator=gen))
    L = backend.cache_length
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):
        for w in widths:
            tree = chain(w - 1)
            tokens = torch.randint(0, vocab, (w,), generator=gen)
            t = time.perf_counter()
            backend.forward(tokens, L + tree.depths, tree.mask, want_hidden=True)
            dt = time.perf_counter() - t
            backend.rollback(L)
            if rep:  # the first round warms every shape up
                times[w].append(dt * 1e3)
    backend.reset()
    return PassCost.monotone(widths, [statistics.median(times[w]) for w in widths])


def machine_key(model_name: str, dtype: torch.dtype, runtime: str) -> str:
    """What a pass's cost depends on: the CPU, the threads, torch, speculant's kernels, the model,
    its dtype and the runtime (backend name and packing)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from .kernels import cpu_kernels

    kernels = "own-kernels" if cpu_kernels() is not None else "torch-kernels"
    return "|".join([cpu, f"{torch.get_num_threads()} threads", f"torch {torch.__version__}", kernels,
                     model_name, str(dtype).removeprefix("torch."), runtime])


def _cache_file() -> Path:
    from .models import cache_dir

    return cache_dir() / "pass_cost.json"


def pass_cost(backend, key: str, *, path: Path | None = None, quiet: bool = False, **measure_kwargs) -> PassCost:
    """The curve for ``key`` (see :func:`machine_key`) from the cache file, or measured now (a few
    seconds for a 1.5B model) and added to it. A cache file that cannot be read is measured over;
    one that cannot be written only costs the measurement next time."""
    path = Path(path) if path is not None else _cache_file()
    try:
        saved = json.loads(path.read_text("utf-8"))
        if saved.get("version") != CACHE_VERSION or not isinstance(saved.get("curves"), dict):
            saved = {}
    except (OSError, ValueError):
        saved = {}
    entry = saved.get("curves", {}).get(key) if saved else None
    if entry is not None:
        try:
            return PassCost(tuple(entry["rows"]), tuple(entry["ms"]))
        except (ConfigError, KeyError, TypeError):
            pass  # a damaged entry: measure again
    if not quiet:
        print("speculant: measuring this machine's verification cost by tree width (once; cached in "
              f"{path})", file=sys.stderr, flush=True)
    cost = measure_pass_cost(backend, **measure_kwargs)
    if not quiet:
        rel = ", ".join(f"{r}: {x:.2f}x" for r, x in cost.relative().items() if r in (1, 8, 16, 32))
        print(f"speculant: one row {cost.ms[0]:.0f} ms; relative cost by rows {rel}", file=sys.stderr, flush=True)
    curves = dict(saved.get("curves", {})) if saved else {}
    curves[key] = cost.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "curves": curves}, indent=1), "utf-8")
        os.replace(tmp, path)
    except OSError as e:
        if not quiet:
            print(f"speculant: could not cache the measured cost ({e}); it will be measured again next time",
                  file=sys.stderr, flush=True)
    return cost
