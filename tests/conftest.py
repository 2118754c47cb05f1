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


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread (no inter-op overhead); real-model tests keep all."""
    if request.node.get_closest_marker("real"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
