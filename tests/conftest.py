import pytest
import torch


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
