"""Milliseconds per target forward pass, per backend and quantization, at several widths.

    python -m speculant.bench.steptime --target qwen2.5-coder-1.5b-instruct --rows 1,4,8,16,32

For each configuration: prefill a fixed context (``--context`` tokens), then time forward passes
of ``rows`` new tokens under a chain (causal) mask after that context, rolling the cache back after
each pass so every pass sees the same context. Reports the median over ``--reps`` passes (these
machines are shared: medians of interleaved repetitions, not single timings). Also times one
prefill of the context per configuration.

Two clocks: wall time, and the process's CPU time (``time.process_time``, all threads). On a
machine shared with other jobs (run under ``nice``) the wall time mostly measures the scheduler;
with ``--threads 1`` the CPU time is close to what the pass costs on an idle core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..backends.hf import HFBackend
from ..backends.native import NativeBackend, NativeModel
from ..store.models import load

CONFIGS = ("hf", "native", "native-int8", "native-int4", "native-int8-lean", "native-int4-lean")


def _backend(model, config: str, quant_head: bool):
    if config == "hf":
        return HFBackend(model)
    parts = config.split("-")
    quant = parts[1] if len(parts) > 1 else "none"
    lean = parts[-1] == "lean"
    return NativeBackend(NativeModel.from_hf(model, quant, quant_head=quant_head and quant != "none",
                                             keep_dense=not lean))


def measure(target: str, configs, rows, context: int, reps: int, dtype: str = "bfloat16",
            quant_head: bool = False) -> dict:
    lm = load(target, dtype)
    # native backends first: they share the model's nn.Linear weights, which the hf backend then
    # packs (packing.py) — built the other way round, a native backend would unpack them again
    made = {c: _backend(lm.model, c, quant_head) for c in sorted(configs, key=lambda c: c == "hf")}
    backends = {c: made[c] for c in configs}
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 20000, (context,), generator=g)
    times: dict[str, dict[int, list[float]]] = {c: {r: [] for r in rows} for c in configs}
    cpu: dict[str, dict[int, list[float]]] = {c: {r: [] for r in rows} for c in configs}
    prefill: dict[str, list[float]] = {c: [] for c in configs}
    with torch.inference_mode():
        for b in backends.values():  # warm-up: one prefill and one pass per width
            b.reset()
            b.forward(ctx, rows=torch.empty(0, dtype=torch.long))
            for r in rows:
                b.forward(ctx[:r])
                b.rollback(context)
        for _ in range(reps):  # interleave configurations so load changes hit them all alike
            for c, b in backends.items():
                for r in rows:
                    toks = torch.randint(100, 20000, (r,), generator=g)
                    t, tc = time.perf_counter(), time.process_time()
                    b.forward(toks, rows=torch.arange(r))
                    times[c][r].append((time.perf_counter() - t) * 1e3)
                    cpu[c][r].append((time.process_time() - tc) * 1e3)
                    b.rollback(context)
        for c, b in backends.items():
            b.reset()
            tc = time.process_time()
            b.forward(ctx, rows=torch.empty(0, dtype=torch.long))
            prefill[c].append((time.process_time() - tc) * 1e3)
    return {"target": target, "dtype": dtype, "context": context, "reps": reps, "threads": torch.get_num_threads(),
            "quant_head": quant_head,
            "ms_per_pass": {c: {str(r): statistics.median(v) for r, v in d.items()} for c, d in times.items()},
            "cpu_ms_per_pass": {c: {str(r): statistics.median(v) for r, v in d.items()} for c, d in cpu.items()},
            "prefill_cpu_ms": {c: v[0] for c, v in prefill.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--configs", default="hf,native,native-int8,native-int4")
    p.add_argument("--rows", default="1,4,8,16,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quant-head", action="store_true", help="quantize the output layer too")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = measure(a.target, a.configs.split(","), [int(r) for r in a.rows.split(",")], a.context, a.reps,
                  quant_head=a.quant_head)
    rows = list(next(iter(res["ms_per_pass"].values())))
    for clock in ("cpu_ms_per_pass", "ms_per_pass"):
        print(f"{clock} (median of {a.reps}), {res['threads']} thread(s); prefill of {a.context} tokens in CPU ms")
        print(f"{'config':>18} " + " ".join(f"{r + ' rows':>9}" for r in rows) + f" {'prefill':>9}")
        for c, d in res[clock].items():
            print(f"{c:>18} " + " ".join(f"{d[r]:9.1f}" for r in rows) + f" {res['prefill_cpu_ms'][c]:9.0f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
