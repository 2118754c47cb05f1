"""A pass-cost curve measured while other jobs held the cores is used but not cached."""

import json
import os
import subprocess
import sys

import pytest

import speculant.tuning.costmodel as cm
from speculant.backends.hf import HFBackend
from speculant.tuning.costmodel import PassCost, pass_cost, runqueue_wait_s, waited_share
from tiny import tiny_llama

needs_schedstat = pytest.mark.skipif(runqueue_wait_s() is None, reason="this kernel does not report schedstat")


def test_waited_share():
    assert waited_share(2.0, 1.0, threads=2) == pytest.approx(0.25)
    assert waited_share(0.0, 1.0, threads=2) == 0.0
    assert PassCost((1, 2), (1.0, 2.0), waited=0.5) == PassCost((1, 2), (1.0, 2.0))  # not part of the curve


@pytest.mark.parametrize("waited, cached", [(0.5, False), (0.01, True)])
def test_a_busy_measurement_is_not_cached(tmp_path, monkeypatch, capsys, waited, cached):
    backend = HFBackend(tiny_llama(seed=0, vocab=64, hidden=32))
    real = cm.measure_pass_cost
    monkeypatch.setattr(cm, "measure_pass_cost", lambda *a, **k: PassCost(real(*a, **k).rows, (1.0, 2.0), waited=waited))
    path = tmp_path / "pass_cost.json"
    cost = pass_cost(backend, "machine", path=path, widths=(1, 2), context=4, long_context=0, reps=1)
    assert cost.ms == (1.0, 2.0)
    assert path.exists() == cached
    err = capsys.readouterr().err
    assert ("busy with other jobs" in err) == (not cached)
    if cached:
        assert json.loads(path.read_text())["curves"]["machine"]["ms"] == [1.0, 2.0]


SPIN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end:\n    pass\n"


@needs_schedstat
def test_runqueue_wait_grows_when_other_jobs_hold_every_core():
    """Negative control for the detector: with two spinning processes per core (and this one
    spinning too), this process waits for a core a measurable share of the time."""
    import time

    others = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.5)]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # let them start
        w0, t0 = runqueue_wait_s(), time.perf_counter()
        exec(SPIN.format(s=1.5))
        share = waited_share(time.perf_counter() - t0, runqueue_wait_s() - w0, threads=1)
    finally:
        for p in others:
            p.wait()
    assert share > 0.2
