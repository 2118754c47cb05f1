"""A kernel build killed mid-compile (the Python process and its compilers, SIGKILL) leaves nothing
that makes the next load hang or load a broken module: the next process says it compiles again,
and its module works. The build path is speculant's own (``kernels._build``: its flock, PyTorch's
leftover ``lock``, the message), on a small probe extension in a fresh TORCH_EXTENSIONS_DIR, so the
kill and the rebuild take seconds, not the minutes of the real modules (which every real-model
test builds through the same path)."""

from __future__ import annotations

import shutil
import time

import pytest

from crash_helpers import Child

PROBE = r"""
#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""
BUILD_AND_CHECK = r"""
import sys
import torch
from speculant.kernels import _build
m = _build("speculant_probe_kernels", [sys.argv[1]], ["-O2"])
assert m is not None, "the probe extension did not build"
assert torch.equal(m.twice(torch.arange(4.0)), torch.arange(4.0) * 2)
print("kernels ok")
"""


def _build_directory_in(ext, name: str):
    """Where speculant's ``_build`` compiles ``name`` with ``TORCH_EXTENSIONS_DIR=ext`` (its own
    answer, so the test follows the directory's naming)."""
    from speculant.kernels import _build_directory

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(ext))
        return _build_directory(name)


def _toolchain() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return bool(shutil.which("g++")) and is_ninja_available()


@pytest.mark.slow
@pytest.mark.skipif(not _toolchain(), reason="needs g++ and ninja")
def test_kernel_build_killed_midway_is_rebuilt_and_works(tmp_path):
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    ext = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    build = _build_directory_in(ext, "speculant_probe_kernels")
    first = Child(BUILD_AND_CHECK, source, log=tmp_path / "first", env=env)
    first.wait_until((build / "build.ninja").exists, 120, "the start of the compilation")
    time.sleep(3)  # the compiler is running now (PyTorch's headers alone take it longer than this)
    assert first.proc.poll() is None, "the build ended within 3 s: nothing left to interrupt"
    first.kill()  # the Python process and its compilers
    assert not (build / "speculant_probe_kernels.so").exists()
    assert (build / "lock").exists()  # PyTorch's own guard, left behind: alone it would stall every later load

    second = Child(BUILD_AND_CHECK, source, log=tmp_path / "second", env=env)
    assert second.finish(600) == 0, second.stderr()[-3000:]
    assert "kernels ok" in second.stdout()
    assert "speculant: an earlier build was interrupted; compiling speculant's CPU kernels (speculant_probe_kernels)" \
        in second.stderr()
    assert not (build / "lock").exists()

    third = Child(BUILD_AND_CHECK, source, log=tmp_path / "third", env=env)  # cached now: loads, compiles nothing
    assert third.finish(120) == 0 and "kernels ok" in third.stdout(), third.stderr()[-3000:]
    assert "compiling" not in third.stderr()
