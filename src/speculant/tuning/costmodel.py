"""What one verification pass of the target costs on this machine, by the number of rows it scores.

The right size of a draft tree depends on the hardware, not only on the heads: where a pass is
bound by reading the weights (AMX), 16 rows cost little more than one; where it is bound by the
arithmetic (AVX-512 without AMX), every row adds to it, and more so as the context grows
(attention). Measurements: docs/design-notes.md#tree-size-follows-the-machine. :func:`pass_cost`
measures the curve once per machine, model, dtype and runtime (widths 1-32 after 64 tokens, and
a few again after 512; seconds for a 1.5B model), caches it under
``$SPECULANT_CACHE``, and the dynamic tree (``drafters.dynamic_tree``, ``tuning.sizing``) sizes every
step's tree against it at that step's context length.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..backends.base import HiddenNeed
from ..errors import ConfigError
from ..trees.buffers import chain

__all__ = ["PassCost", "measure_pass_cost", "pass_cost", "machine_key", "runqueue_wait_s", "waited_share"]

WIDTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32)
LONG_WIDTHS = (1, 16, 32)  # re-timed after a longer context, for the cost's growth with it
CACHE_VERSION = 3


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear through (xs, ys), xs ascending; past the last point along the last segment."""
    if len(xs) == 1:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            a, b = xs[i - 1], xs[i]
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - a) / (b - a)
    raise AssertionError("unreachable")


def _running_max(values) -> tuple[float, ...]:
    out, top = [], float("-inf")
    for v in values:
        top = max(top, float(v))
        out.append(top)
    return tuple(out)


@dataclass(frozen=True)
class PassCost:
    """Milliseconds of one target pass scoring ``rows[i]`` rows after ``context`` cached tokens:
    ``ms[i]``, plus ``slope[i]`` ms for every further token of context (attention reads the whole
    context for every row; empty: the cost does not grow with context). Rows ascend from 1; ``ms``
    and ``slope`` never decrease along the rows (a measured curve is made so with running maxima:
    a wider pass is never cheaper, whatever the noise said)."""

    rows: tuple[int, ...]
    ms: tuple[float, ...]
    context: int = 0
    slope: tuple[float, ...] = ()
    # share of its threads' time the measurement waited for a core (above BUSY_WAIT: a busy machine)
    waited: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        rows, ms = tuple(int(r) for r in self.rows), tuple(float(m) for m in self.ms)
        slope = tuple(float(x) for x in self.slope)
        if not rows or len(rows) != len(ms) or (slope and len(slope) != len(rows)):
            raise ConfigError(f"a pass-cost curve needs as many times (and slopes, if any) as widths, got "
                              f"{len(rows)} widths, {len(ms)} times and {len(slope)} slopes")
        if rows[0] != 1 or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ConfigError(f"pass-cost widths must start at 1 and increase, got {list(rows)}")
        if any(not (m > 0) for m in ms) or any(b < a for a, b in zip(ms, ms[1:])):
            raise ConfigError(f"pass-cost times must be positive and non-decreasing, got {list(ms)}")
        if any(x < 0 for x in slope) or any(b < a for a, b in zip(slope, slope[1:])):
            raise ConfigError(f"pass-cost slopes must be >= 0 and non-decreasing, got {list(slope)}")
        if self.context < 0:
            raise ConfigError(f"a pass-cost context must be >= 0 tokens, got {self.context}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "ms", ms)
        object.__setattr__(self, "slope", slope)

    @classmethod
    def monotone(cls, rows, ms, context: int = 0, slope=()) -> "PassCost":
        """The curve through measured (noisy) points: running maxima over times and slopes, and
        negative slopes (noise) as 0."""
        return cls(tuple(rows), _running_max(ms), context, _running_max(max(float(x), 0.0) for x in slope))

    def __call__(self, n: int, context: int | None = None) -> float:
        """Milliseconds for ``n >= 1`` rows (after ``context`` cached tokens, if given): linear
        between measured widths, and past the widest along the last segment's slope; never below
        half the cost at the measured context."""
        if n < 1:
            raise ValueError(f"a pass scores at least one row, got {n}")
        base = _interp(self.rows, self.ms, n)
        if context is None or not self.slope:
            return base
        return max(base + _interp(self.rows, self.slope, n) * (context - self.context), 0.5 * base)

    def relative(self) -> dict[int, float]:
        """Each measured width's cost over one row's, at the measured context: {rows: ratio}."""
        return {r: m / self.ms[0] for r, m in zip(self.rows, self.ms)}

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "ms": [round(m, 3) for m in self.ms], "context": self.context,
                "slope": [round(x, 5) for x in self.slope]}


# A measurement counts as taken on a busy machine when its threads spent more than this share of
# their time runnable but waiting for a core (other jobs held it; Linux's per-thread schedstat):
# its timings then measure the scheduler (an OpenMP barrier waits for a descheduled thread), so it
# is not cached. See docs/design-notes.md#pass-cost-measured-on-a-quiet-machine.
BUSY_WAIT = 0.2


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over its
    threads (``/proc/self/task/*/schedstat``); None where the kernel does not report it."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def waited_share(wall_s: float, waited_s: float, threads: int | None = None) -> float:
    """Share of ``threads`` threads' time over ``wall_s`` spent waiting for a core."""
    n = threads or max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    return waited_s / (wall_s * n) if wall_s > 0 else 0.0


@torch.inference_mode()
def measure_pass_cost(backend, widths=WIDTHS, context: int = 64, long_context: int = 512,
                      long_widths=LONG_WIDTHS, reps: int = 3, seed: int = 0) -> PassCost:
    """Time ``backend.forward`` on tree passes of each width after ``context`` cached tokens, then
    ``long_widths`` again after ``long_context`` (0: skip; the cost's growth with context, per
    width, is the slope between the two, interpolated over the other widths).

    Widths are taken round-robin ``reps`` times (so drift over the run touches every width alike)
    after one untimed round; the median of each width's times counts. The cache is rolled back
    after every pass and reset at the end. Passes ask for every row's logits and hidden state, as
    a heads method's verification does."""
    widths = sorted({int(w) for w in widths})
    if not widths or widths[0] != 1:
        raise ConfigError(f"pass-cost widths must include 1 (plain decoding), got {widths}")
    if context < 1 or reps < 1 or (long_context and long_context <= context):
        raise ConfigError(f"need context >= 1, reps >= 1 and long_context 0 or > context, got {context}, {reps} "
                          f"and {long_context}")
    gen = torch.Generator().manual_seed(seed)
    vocab = int(backend.vocab_size)

    def timed(ws) -> dict[int, float]:
        L = backend.cache_length
        times: dict[int, list[float]] = {w: [] for w in ws}
        for rep in range(reps + 1):
            for w in ws:
                tree = chain(w - 1)
                tokens = torch.randint(0, vocab, (w,), generator=gen)
                t = time.perf_counter()
                backend.forward(tokens, L + tree.depths, tree.mask, want_hidden=HiddenNeed.LAST)
                dt = time.perf_counter() - t
                backend.rollback(L)
                if rep:  # the first round warms every shape up
                    times[w].append(dt * 1e3)
        return {w: statistics.median(v) for w, v in times.items()}

    backend.reset()
    backend.forward(torch.randint(0, vocab, (context,), generator=gen))
    wall0, wait0 = time.perf_counter(), runqueue_wait_s()
    short = timed(widths)
    slope: tuple[float, ...] = ()
    if long_context:
        backend.forward(torch.randint(0, vocab, (long_context - context,), generator=gen))
        lw = sorted({1, *(int(w) for w in long_widths if int(w) in short)})
        far = timed(lw)
        at = tuple((far[w] - short[w]) / (long_context - context) for w in lw)
        slope = tuple(max(_interp(tuple(lw), at, w), 0.0) for w in widths)
    wait1 = runqueue_wait_s()
    waited = (waited_share(time.perf_counter() - wall0, wait1 - wait0)
              if wait0 is not None and wait1 is not None else 0.0)
    backend.reset()
    return replace(PassCost.monotone(widths, [short[w] for w in widths], context, slope), waited=waited)


def machine_key(model_name: str, dtype: torch.dtype, runtime: str) -> str:
    """What a pass's cost depends on: the CPU, the threads, torch, speculant's kernels (which ones
    run here, and their sources), the model, its dtype and the runtime (backend name and packing)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from ..kernels import int4_isa, kernels_name, sources_digest

    kernels = f"{kernels_name()}-kernels+int4-{int4_isa() or 'none'}@{sources_digest()}"
    return "|".join([cpu, f"{torch.get_num_threads()} threads", f"torch {torch.__version__}", kernels,
                     model_name, str(dtype).removeprefix("torch."), runtime])


def _cache_file() -> Path:
    from ..runtime.process import cache_dir

    return cache_dir() / "pass_cost.json"


def _read_cache(path: Path) -> tuple[dict, str | None]:
    """The saved curves file ({} if missing, of another version or damaged) and what was wrong
    with it, if it was damaged."""
    try:
        saved = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"it cannot be read ({type(e).__name__}: {e})"
    if not isinstance(saved, dict):
        return {}, f"it holds a JSON {type(saved).__name__}, not an object"
    if saved.get("version") != CACHE_VERSION:
        return {}, None  # another version's format: measured over, silently
    if not isinstance(saved.get("curves"), dict):
        return {}, "it has no \"curves\" object"
    return saved, None


def pass_cost(backend, key: str, *, path: Path | None = None, quiet: bool = False, **measure_kwargs) -> PassCost:
    """The curve for ``key`` (see :func:`machine_key`) from the cache file, or measured now (a few
    seconds for a 1.5B model) and added to it. A cache file that cannot be read is measured over;
    one that cannot be written only costs the measurement next time."""
    path = Path(path) if path is not None else _cache_file()
    saved, damage = _read_cache(path)
    entry = saved.get("curves", {}).get(key) if saved else None
    if entry is not None:
        try:
            return PassCost(tuple(entry["rows"]), tuple(entry["ms"]), int(entry["context"]), tuple(entry["slope"]))
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            damage = f"its entry for this machine is damaged ({type(e).__name__}: {e})"
    if damage and not quiet:
        print(f"speculant: ignoring the pass-cost cache {path}: {damage}; measuring again", file=sys.stderr, flush=True)
    if not quiet:
        print("speculant: measuring this machine's verification cost by tree width (once; cached in "
              f"{path})", file=sys.stderr, flush=True)
    cost = measure_pass_cost(backend, **measure_kwargs)
    if not quiet:
        rel = ", ".join(f"{r}: {cost(r, 512) / cost(1, 512):.2f}x" for r in (8, 16, 32))
        print(f"speculant: one row {cost(1, 512):.0f} ms after 512 tokens; relative cost by rows {rel}",
              file=sys.stderr, flush=True)
    if cost.waited > BUSY_WAIT:  # other jobs held the cores: use it for this process only
        if not quiet:
            print(f"speculant: the CPU was busy with other jobs while measuring (speculant's threads waited "
                  f"{cost.waited:.0%} of their time for a core), so the measurement is used for this run only "
                  f"and not cached; it is taken again next time", file=sys.stderr, flush=True)
        return cost
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
