"""A kernel build killed mid-compile (the Python process and its compilers, SIGKILL) leaves nothing
that makes the next load hang or load a broken module: the next process says it compiles again,
and its kernels match a reference. One kill and one rebuild of the x86 module (the one every x86-64
CPU builds) in a fresh TORCH_EXTENSIONS_DIR: 1-3 minutes."""

from __future__ import annotations

import platform
import shutil
import sys
import time

import pytest

from crash_helpers import Child

BUILD_AND_CHECK = r"""
import torch
from speculant.kernels import x86_kernels
m = x86_kernels()
assert m is not None, "speculant's x86 kernels did not build"
g = torch.Generator().manual_seed(0)
x = (torch.randn(5, 96, generator=g) * 3).bfloat16()
w = torch.randn(96, generator=g).bfloat16()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
torch.testing.assert_close(m.rms_norm(x, w, 1e-6, 4).float(), ref, atol=0.02, rtol=0.01)
print("kernels ok")
"""


def _toolchain() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return platform.machine().lower() in ("x86_64", "amd64") and bool(shutil.which("g++")) and is_ninja_available()


@pytest.mark.slow
@pytest.mark.skipif(not _toolchain(), reason="needs an x86-64 CPU, g++ and ninja")
def test_kernel_build_killed_midway_is_rebuilt_and_works(tmp_path):
    ext = tmp_path / "torch_extensions"
    build = ext / f"speculant_x86_kernels-py{sys.version_info.major}{sys.version_info.minor}"
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    first = Child(BUILD_AND_CHECK, log=tmp_path / "first", env=env)
    first.wait_until((build / "build.ninja").exists, 120, "the start of the compilation")
    time.sleep(4)  # the compilers are running now
    assert first.proc.poll() is None, "the build ended within 4 s: nothing left to interrupt"
    first.kill()  # the Python process and its compilers
    assert not (build / "speculant_x86_kernels.so").exists()
    assert (build / "lock").exists()  # PyTorch's own guard, left behind: alone it would stall every later load

    second = Child(BUILD_AND_CHECK, log=tmp_path / "second", env=env)
    assert second.finish(900) == 0, second.stderr()[-3000:]
    assert "kernels ok" in second.stdout()
    assert "speculant: an earlier build was interrupted; compiling speculant's CPU kernels (speculant_x86_kernels)" \
        in second.stderr()
    assert not (build / "lock").exists()

    third = Child(BUILD_AND_CHECK, log=tmp_path / "third", env=env)  # cached now: loads, compiles nothing
    assert third.finish(120) == 0 and "kernels ok" in third.stdout(), third.stderr()[-3000:]
    assert "compiling" not in third.stderr()
