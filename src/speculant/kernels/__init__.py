"""speculant's own CPU kernels, compiled on first use with PyTorch's C++ extension builder
(one module, :func:`cpu_kernels`).

``int4_amx.cpp``: an int4-weight matmul for a few rows whose cost stays about that of reading the
weights from 1 to 16 rows (AMX-INT8 tiles; activations quantized per row and per 64 inputs to
int8, as llama.cpp does), and whose rows are computed independently of each other (a tree
verification pass gives each row exactly what a one-row pass gives). Needs AMX-INT8 and AVX-512
BF16 (Intel Sapphire Rapids and later) on Linux. Without them, or if the build fails,
:func:`cpu_kernels` returns None and callers use PyTorch's own kernels.

``attention.cpp``: attention of a few new tokens over the bf16 KV cache, each (token, head)
computed on its own over the keys it may see, in key order, so a tree verification pass is
row-invariant there too (PyTorch's fused attention blocks rows and keys by the call's shape).

The build (g++ and ninja, ~30 s) is cached by PyTorch under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); later loads take well under a second.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

__all__ = ["GROUP", "cpu_has_amx_int8", "cpu_kernels", "dequantize_int4", "pack_bf16", "pack_int4"]

GROUP = 64  # input channels per (scale, offset) group: one AMX tile step

def cpu_has_amx_int8() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"amx_int8", "amx_bf16", "amx_tile", "avx512_bf16", "avx512bw"} <= flags


@functools.cache
def cpu_kernels():
    """The compiled extension module (``.int4_mm(x, qpack, scales)``, ``.attend(q, keys, values,
    allowed)``), or None where it cannot run. ``SPECULANT_NO_KERNELS=1`` disables it (PyTorch's
    kernels are used instead). Built (or loaded) once per process."""
    if os.environ.get("SPECULANT_NO_KERNELS") or not cpu_has_amx_int8():
        return None
    try:
        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        module = load(name="speculant_cpu_kernels", sources=[str(here / "int4_amx.cpp"), str(here / "attention.cpp"),
                                                               str(here / "bf16_amx.cpp")],
                      extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile",
                                    "-mamx-int8", "-mamx-bf16", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)
        if not module.amx_available():
            raise RuntimeError("the operating system refused AMX tile data to this process")
        return module
    except Exception as e:  # noqa: BLE001 - no compiler / ninja / AMX: fall back, say why once
        warnings.warn(f"speculant's CPU kernels are not available ({type(e).__name__}: {e}); using PyTorch's "
                      "instead (int4: its cost grows with the rows verified)", RuntimeWarning, stacklevel=2)
        return None


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q (N, K) in [0, 15], scale and offset (N, K / 64) (w = q * scale + offset) ->
    (qpack (N/16, K/4, 32) uint8, scales (N/16, K/64, 2, 16) bf16) in the kernel's layout (see
    int4_amx.cpp). N must be a multiple of 16 and K of 64."""
    N, K = q.shape
    if N % 16 or K % GROUP:
        raise ValueError(f"pack_int4 needs N % 16 == 0 and K % {GROUP} == 0, got ({N}, {K})")
    rows = q.to(torch.uint8).view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).reshape(N // 16, K // 4, 64)
    qpack = (rows[..., :32] | (rows[..., 32:] << 4)).contiguous()  # (nb, quad, 32)
    G = K // GROUP
    sz = torch.stack([scale, offset], dim=0).view(2, N // 16, 16, G).permute(1, 3, 0, 2)  # (nb, g, 2, 16)
    return qpack, sz.to(torch.bfloat16).contiguous()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) -> (N/16, K/32, 16, 16, 2) bf16, the AMX B tiles of bf16_amx.cpp: element
    [nb, ks, p, c, i] = W[16 nb + c, 32 ks + 2 p + i]. N must be a multiple of 32, K of 32."""
    N, K = weight.shape
    if N % 32 or K % 32:
        raise ValueError(f"pack_bf16 needs N % 32 == 0 and K % 32 == 0, got ({N}, {K})")
    w = weight.detach().to(torch.bfloat16).view(N // 16, 16, K // 32, 16, 2)
    return w.permute(0, 2, 3, 1, 4).contiguous()


def dequantize_int4(qpack: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The (N, K) matrix a packed weight stands for (w = q * scale + offset, in ``dtype``)."""
    NB, quads, _ = qpack.shape
    rows = torch.cat([qpack & 15, qpack >> 4], dim=-1)  # (nb, quad, 64): byte 4c + i
    q = rows.view(NB, quads, 16, 4).permute(0, 2, 1, 3).reshape(NB * 16, quads * 4)  # (N, K)
    s, o = scales.float().permute(2, 0, 3, 1).reshape(2, NB * 16, -1)  # (N, G) each
    w = q.view(NB * 16, -1, GROUP).float() * s[..., None] + o[..., None]
    return w.view(NB * 16, quads * 4).to(dtype)
