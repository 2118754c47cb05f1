import pytest
import torch


@pytest.fixture(scope="session")
def _tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("speculant-cache")


@pytest.fixture(autouse=True)
def _private_cache_for_tiny_models(request, _tiny_cache, monkeypatch):
    """Tiny-model tests write what they cache (e.g. a measured pass-cost curve) to a temporary
    directory, not to the user's ~/.cache/speculant; real-model tests keep the real cache."""
    if not request.node.get_closest_marker("real"):
        monkeypatch.setenv("SPECULANT_CACHE", str(_tiny_cache))
    yield


def _cores_per_process() -> int:
    """This test process's share of the cores: all of them alone, cores / processes under
    pytest-xdist (two processes each running on every core would both spin-wait for cores the
    other holds: a real-model test then takes several times as long)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, cores // max(1, workers))


def pytest_configure(config):
    """Every test process, and the processes its tests start, on its share of the cores."""
    import os

    share = _cores_per_process()
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(share)


@pytest.fixture(autouse=True)
def _threads_for_the_test(request):
    """Tiny models run fastest on one thread (no inter-op overhead); real-model tests take this
    process's share of the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(_cores_per_process() if request.node.get_closest_marker("real") else 1)
    yield
    torch.set_num_threads(before)
