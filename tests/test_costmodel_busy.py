"""A pass-cost curve measured while other jobs held the cores is used but not cached."""

import json

import pytest

import speculant.costmodel as cm
from speculant.backends.hf import HFBackend
from speculant.costmodel import PassCost, cpu_share, pass_cost
from tiny import tiny_llama


def test_cpu_share():
    assert cpu_share(2.0, 1.0) == pytest.approx(0.5)
    assert cpu_share(0.0, 0.0) == 1.0
    assert PassCost((1, 2), (1.0, 2.0), cpu_share=0.3) == PassCost((1, 2), (1.0, 2.0))  # not part of the curve


@pytest.mark.parametrize("share, cached", [(0.3, False), (0.95, True)])
def test_a_busy_measurement_is_not_cached(tmp_path, monkeypatch, capsys, share, cached):
    backend = HFBackend(tiny_llama(seed=0, vocab=64, hidden=32))
    real = cm.measure_pass_cost
    monkeypatch.setattr(cm, "measure_pass_cost", lambda *a, **k: PassCost(real(*a, **k).rows, (1.0, 2.0), cpu_share=share))
    path = tmp_path / "pass_cost.json"
    cost = pass_cost(backend, "machine", path=path, widths=(1, 2), context=4, long_context=0, reps=1)
    assert cost.ms == (1.0, 2.0)
    assert path.exists() == cached
    err = capsys.readouterr().err
    assert ("busy with other jobs" in err) == (not cached)
    if cached:
        assert json.loads(path.read_text())["curves"]["machine"]["ms"] == [1.0, 2.0]


def test_an_idle_measurement_of_a_tiny_model_counts_as_idle():
    """The measuring thread runs the whole time on an idle machine (the test suite runs alone)."""
    backend = HFBackend(tiny_llama(seed=0, vocab=64, hidden=32))
    cost = cm.measure_pass_cost(backend, widths=(1, 2, 4), context=8, long_context=0, reps=3)
    assert 0.0 < cost.cpu_share <= 1.05
