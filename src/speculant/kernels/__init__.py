"""speculant's own CPU kernels, compiled on first use with PyTorch's C++ extension builder: one
module for AMX or AVX-512 BF16 CPUs (:func:`cpu_kernels`) and one for every x86-64 CPU
(:func:`x86_kernels`: ``int4_x86.cpp``, ``attention_x86.cpp``, ``layer_x86.cpp``, each on an
AVX-512, AVX2 and portable C++ path that give the same bits).

``int4_x86.cpp``: the int4-weight matmul of every x86-64 CPU, one packed layout
(:func:`pack_int4_x86`) for all of its code paths: AVX-512 VNNI, AVX2 with or without AVX-VNNI,
portable C++, and on AMX CPUs (Intel Sapphire Rapids and later) AMX tiles for passes of 10 rows
or more (32 for a GGUF file's blocks: ``int4_amx_x86.cpp``). Activations are quantized per row
and per group of inputs to int8, as llama.cpp does, and every row is computed on its own, so a
tree verification pass gives each row exactly what a one-row pass gives, on every path alike.

``bf16_amx.cpp``: a bf16 matmul on AMX tiles, each weight tile used by up to 32 rows (measurements:
docs/design-notes.md#bf16-kernel-with-amx). Needs AMX and AVX-512 BF16 (Intel Sapphire Rapids and
later) on Linux; its module (``amx_module.cpp``) also has attention.cpp.

``bf16_avx512.cpp``: bf16_amx.cpp's matmul (same interface and layout) for CPUs with AVX-512
BF16 but no AMX (AMD Zen 4 and later): VDPBF16PS, each weight vector used by up to 6 rows at
once, rows independent of each other too (measurements: docs/design-notes.md#bf16-kernel-without-amx).
On such a CPU :func:`cpu_kernels` builds this file and attention.cpp. Without either instruction
set, or if the build fails, :func:`cpu_kernels` returns None and callers use PyTorch's kernels.

``attention.cpp``: attention of a few new tokens over the bf16 KV cache, each (token, head)
computed on its own over the keys it may see, in key order, so a tree verification pass is
row-invariant there too (PyTorch's fused attention blocks rows and keys by the call's shape).

The build (g++ and ninja, ~30 s) is cached by PyTorch under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); later loads take well under a second.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["amx_kernels", "GROUP", "INT4_ISAS", "cpu_has_amx_int8", "cpu_has_avx512_bf16", "cpu_kernels",
           "dequantize_int4_x86", "int4_isa", "kernels_name", "pack_bf16", "pack_f32scales_x86", "pack_int4_x86",
           "pack_kquant_x86", "pack_q5k_x86", "pack_q6k_x86", "unpack_int4_x86", "unpack_q5k_x86", "unpack_q6k_x86",
           "x86_kernels"]

GROUP = 64  # input channels per (scale, offset) group: one AMX tile step; docs/design-notes.md#int4-group-size

@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_has_amx_int8() -> bool:
    """AMX-INT8/BF16 here, unless ``SPECULANT_NO_AMX`` is set (speculant then runs as on the same
    CPU without AMX: its AVX-512 kernels, and the int4 matmul's AVX-512 VNNI path at every width)."""
    if os.environ.get("SPECULANT_NO_AMX"):
        return False
    return {"amx_int8", "amx_bf16", "amx_tile", "avx512_bf16", "avx512bw"} <= _cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _cpu_flags()


def _kernel_sources() -> tuple[str, list[str], list[str]] | None:
    """(module name, C++ sources, compiler flags) of the kernels this CPU runs, or None."""
    avx512 = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]
    if cpu_has_amx_int8():
        return ("speculant_cpu_kernels", ["amx_module.cpp", "attention.cpp", "bf16_amx.cpp", "int4_prefill_amx.cpp"],
                avx512 + ["-mamx-tile", "-mamx-int8", "-mamx-bf16"])
    if cpu_has_avx512_bf16():
        return "speculant_avx512_kernels", ["bf16_avx512.cpp", "attention.cpp"], avx512
    return None


def _build_directory(name: str) -> Path:
    """Where module ``name`` is compiled: under ``$TORCH_EXTENSIONS_DIR`` or PyTorch's default root,
    one directory per checkout of the sources (a digest of their path), so two checkouts used in
    turn (a second clone, a git worktree) do not compile over each other's build every time."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    where = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return root / f"{name}-py{sys.version_info.major}{sys.version_info.minor}-{where}"


@functools.cache
def cpu_kernels():
    """The compiled bf16 / attention module, or None where it cannot run. Every module has
    ``.bf16_mm(x, wp, bias)`` and ``.attend(q, keys, values, allowed)`` (int4 layers use
    :func:`x86_kernels`). ``SPECULANT_NO_KERNELS=1`` disables them (PyTorch's kernels are used
    instead). Built (or loaded) once per process."""
    if os.environ.get("SPECULANT_NO_KERNELS"):
        return None
    spec = _kernel_sources()
    if spec is None:
        return None
    name, sources, flags = spec
    module = _build(name, sources, flags)
    if module is not None and hasattr(module, "amx_available") and not module.amx_available():
        warnings.warn("speculant's AMX kernels are not available (the operating system refused AMX tile data to "
                      "this process); using PyTorch's instead", RuntimeWarning, stacklevel=2)
        return None
    return module


def _build(name: str, sources: list[str], flags: list[str]):
    """Compile (or load the cached build of) extension ``name`` from ``sources`` (files of this
    package's directory, or absolute paths); None, with a warning, if that fails."""
    here = Path(__file__).parent
    try:
        from torch.utils.cpp_extension import load

        from ..runtime.process import file_lock

        build = _build_directory(name)
        build.mkdir(parents=True, exist_ok=True)
        # PyTorch guards a build with a `lock` file that a killed build leaves behind, and every
        # later load then waits for it forever. Speculant's processes take this flock first (it
        # dies with its process), so a `lock` found while holding it is such a leftover.
        with file_lock(build / "speculant.flock"):
            _say_if_building(name, build, _with_includes([here / f for f in sources]))
            (build / "lock").unlink(missing_ok=True)
            return load(name=name, sources=[str(here / s) for s in sources], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: fall back, say why once
        warnings.warn(f"speculant's CPU kernels ({name}) are not available ({type(e).__name__}: {e}); using "
                      "PyTorch's instead (bf16: oneDNN's matmul; int4: its cost grows with the rows verified)",
                      RuntimeWarning, stacklevel=3)
        return None


def _with_includes(files: list[Path]) -> list[Path]:
    """``files`` and the local headers they include (``#include "x.h"``), transitively."""
    seen, todo = [], list(files)
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.append(f)
        for line in f.read_text().splitlines():
            if line.startswith('#include "'):
                todo.append(f.parent / line.split('"')[1])
    return seen


def _say_if_building(name: str, build: Path, files: list[Path]) -> None:
    """One line on standard error when ``name`` is (re)compiled: no module yet, its sources
    (``files``) newer than it, or a ``lock`` file left by a build that was killed (its partial
    output is rebuilt)."""
    module = build / f"{name}.so"
    interrupted = (build / "lock").exists()
    newest = max(f.stat().st_mtime for f in files)
    if interrupted or not module.is_file() or module.stat().st_mtime < newest:
        why = "an earlier build was interrupted; " if interrupted else ""
        print(f"speculant: {why}compiling speculant's CPU kernels ({name}) for this machine in {build} "
              "(1-2 minutes, once)", file=sys.stderr, flush=True)


# int4_x86.cpp's code paths: the value int4_gemm's `isa` argument takes for each
INT4_ISAS = {"avx512-vnni": 1, "avx2-vnni": 2, "avx2": 3, "portable": 4, "amx": 5}


@functools.cache
def x86_kernels():
    """The module of ``int4_x86.cpp``, ``attention_x86.cpp`` and ``layer_x86.cpp``, built for any x86-64 CPU (each code
    path compiled for its instruction set, chosen at run time), or None where it cannot be built
    (not x86, no compiler) or ``SPECULANT_NO_KERNELS`` is set. Built (or loaded) once per process."""
    if os.environ.get("SPECULANT_NO_KERNELS") or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return _build("speculant_x86_kernels",
                  ["int4_x86.cpp", "int4_amx_x86.cpp", "attention_x86.cpp", "layer_x86.cpp", "x86_module.cpp"],
                  ["-O3", "-ffp-contract=off", "-fopenmp"])


def int4_isa() -> str | None:
    """The code path of ``int4_x86.cpp`` that runs here: ``SPECULANT_INT4_ISA`` (one of
    :data:`INT4_ISAS`, e.g. ``portable`` to test the fallback) if set, else the best this CPU has
    (not ``amx`` under ``SPECULANT_NO_AMX``); None without the module. Every path gives the same bits."""
    module = x86_kernels()
    if module is None:
        return None
    forced = os.environ.get("SPECULANT_INT4_ISA", "").strip().lower()
    if forced:
        if forced not in INT4_ISAS:
            from ..errors import ConfigError

            raise ConfigError(f"SPECULANT_INT4_ISA={forced!r}: choose one of {', '.join(INT4_ISAS)}")
        if not module.int4_isa_supported(INT4_ISAS[forced]):
            from ..errors import ConfigError

            raise ConfigError(f"SPECULANT_INT4_ISA={forced!r}: this CPU lacks those instructions")
        return forced
    best = module.int4_best_isa()
    if best == INT4_ISAS["amx"] and not cpu_has_amx_int8():  # SPECULANT_NO_AMX
        best = INT4_ISAS["avx512-vnni"]
    return next(name for name, v in INT4_ISAS.items() if v == best)


@functools.cache
def sources_digest() -> str:
    """12 hex digits of a hash of the kernels' C++ sources: what a measured speed of them (a
    pass-cost curve) belongs to, so that a changed kernel is measured again."""
    h = hashlib.sha256()
    for f in sorted(f for f in Path(__file__).parent.iterdir() if f.suffix in (".cpp", ".h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def kernels_name() -> str:
    """Which bf16 matmul and attention kernels run here: "amx" (``bf16_amx.cpp``), "avx512"
    (``bf16_avx512.cpp``) or "torch" (PyTorch's); :func:`int4_isa` names the int4 code path."""
    return "torch" if cpu_kernels() is None else "amx" if cpu_has_amx_int8() else "avx512"


def amx_kernels():
    """The AMX build of :func:`cpu_kernels` (with the prompt prefill kernels: ``int4_prefill_mm`` and
    a GGUF file's blocks' ``*_prefill_mm``), or None where :func:`kernels_name` is not "amx"."""
    return cpu_kernels() if kernels_name() == "amx" else None


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) -> (N/16, K/32, 16, 16, 2) bf16, the AMX B tiles of bf16_amx.cpp: element
    [nb, ks, p, c, i] = W[16 nb + c, 32 ks + 2 p + i]. N must be a multiple of 32, K of 32."""
    N, K = weight.shape
    if N % 32 or K % 32:
        raise ValueError(f"pack_bf16 needs N % 32 == 0 and K % 32 == 0, got ({N}, {K})")
    w = weight.detach().to(torch.bfloat16).view(N // 16, 16, K // 32, 16, 2)
    return w.permute(0, 2, 3, 1, 4).contiguous()


def pack_int4_x86(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q (N, K) in [0, 15], scale and offset (N, G) (w = q * scale + offset, groups of K / G
    inputs) -> (qpack (N/16, K/8, 64) uint8, scales (N/16, G, 2, 16) bf16), the layout of
    int4_x86.cpp: byte 4 c + i of octet p holds q[c, 8 p + i] (low nibble) and q[c, 8 p + 4 + i]
    (high nibble). N must be a multiple of 16, and a group a multiple of 16 inputs."""
    N, K = q.shape
    G = scale.shape[-1]
    if N % 16 or K % 8 or G < 1 or K % G or (K // G) % 16:
        raise ValueError(f"pack_int4_x86 needs N % 16 == 0 and groups of a multiple of 16 inputs, got ({N}, {K}) "
                         f"in {G} groups")
    return _pack_codes(q), _by_block(torch.stack([scale, offset])).to(torch.bfloat16)


def _pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes q (N, K) in [0, 15] -> qpack (N/16, K/8, 64) uint8 (pack_int4_x86's layout)."""
    N, K = q.shape
    r = q.to(torch.uint8).view(N // 16, 16, K // 8, 2, 4)  # [nb, c, octet, half, i]
    return (r[:, :, :, 0] | (r[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(N // 16, K // 8, 64).contiguous()


def _by_block(pair: torch.Tensor) -> torch.Tensor:
    """(2, N, G) -> (N/16, G, 2, 16): each block of 16 channels' two values per group side by side."""
    _, N, G = pair.shape
    return pair.reshape(2, N // 16, 16, G).permute(1, 3, 0, 2).contiguous()


def pack_kquant_x86(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                    m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_K tensor's parts as they are (``runtime.gguf_blocks.q4_k_blocks``): codes q (N, K) in
    [0, 15], each 256-input block's d and dmin (N, K/256), each 32-input group's 6-bit scale and min
    (N, K/32) -> (qpack (N/16, K/8, 64) uint8, kd (N/16, K/256, 2, 16) float32 holding d and -dmin,
    km (N/16, K/32, 2, 16) uint8 holding scale and min): the arguments of ``int4_gemm_kquant``, whose
    weight is w = q * (d * scale) + (-dmin) * min, in fp32. N must be a multiple of 16, K of 256."""
    N, K = q.shape
    if N % 16 or K % 256 or d.shape != (N, K // 256) or dmin.shape != d.shape or sc.shape != (N, K // 32) \
            or m.shape != sc.shape:
        raise ValueError(f"pack_kquant_x86 needs N % 16 == 0, K % 256 == 0, d and dmin (N, K/256), scale and min "
                         f"(N, K/32); got codes {tuple(q.shape)}, d {tuple(d.shape)}, dmin {tuple(dmin.shape)}, "
                         f"scale {tuple(sc.shape)}, min {tuple(m.shape)}")
    kd = _by_block(torch.stack([d.float(), -dmin.float()]))
    km = _by_block(torch.stack([sc.to(torch.uint8), m.to(torch.uint8)]))
    return _pack_codes(q), kd, km


def pack_q5k_x86(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                 m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q5_K tensor's parts as they are (``runtime.gguf_blocks.q5_k_blocks``: pack_kquant_x86's
    with codes q in [0, 31]) -> (qpack, qh, kd, km): pack_kquant_x86's qpack of the codes' low 4 bits,
    kd and km, and qh (N/16, K/32, 64) uint8 their fifth bits, byte 4 c + i of input chunk P holding
    that of input 32 P + 4 j + i in bit j: the arguments of ``int4_gemm_q5k``."""
    qpack, kd, km = pack_kquant_x86(q.to(torch.uint8) & 15, d, dmin, sc, m)
    return qpack, _fifth_bits(q), kd, km


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """Codes q (N, K) in [0, 31] -> their fifth bits (N/16, K/32, 64) uint8, byte 4 c + i of input
    chunk P holding that of input 32 P + 4 j + i in bit j (``Problem::qh`` with hbits 1)."""
    N, K = q.shape
    fifth = (q.to(torch.uint8) >> 4).view(N // 16, 16, K // 32, 8, 4)  # [nb, c, chunk, j, i]
    byte = sum(fifth[:, :, :, j] << j for j in range(8))
    return byte.permute(0, 2, 1, 3).reshape(N // 16, K // 32, 64).contiguous()


def pack_f32scales_x86(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int = 4
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q (N, K) in [0, 2^bits - 1] (``bits`` 4 or 5), scale and offset (N, G) float32
    (w = q * scale + offset, groups of K / G inputs) -> (qpack (N/16, K/8, 64) uint8 of the codes'
    low 4 bits, sf (N/16, G, 2, 16) float32, qh: for 5-bit codes their fifth bits (N/16, K/32, 64)
    uint8 (groups of 32 then), else empty): the arguments of ``int4_gemm_f32``, pack_int4_x86's
    layout with exact scales. N must be a multiple of 16, a group a multiple of 16 inputs."""
    N, K = q.shape
    G = scale.shape[-1]
    if N % 16 or K % 8 or G < 1 or K % G or (K // G) % 16 or offset.shape != scale.shape:
        raise ValueError(f"pack_f32scales_x86 needs N % 16 == 0 and groups of a multiple of 16 inputs, got ({N}, {K}) "
                         f"in {G} groups, scale {tuple(scale.shape)}, offset {tuple(offset.shape)}")
    if bits not in (4, 5) or (bits == 5 and K // G != 32):
        raise ValueError(f"pack_f32scales_x86 takes 4-bit codes, or 5-bit codes in groups of 32; got {bits} bits in "
                         f"groups of {K // G}")
    codes = q.to(torch.uint8)
    qh = _fifth_bits(codes) if bits == 5 else torch.empty(0, dtype=torch.uint8)
    return _pack_codes(codes & 15), _by_block(torch.stack([scale.float(), offset.float()])), qh


def unpack_q5k_x86(qpack: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """The codes q (N, K) uint8 in [0, 31] of a packed Q5_K weight (pack_q5k_x86's inverse)."""
    NB, chunks, _ = qh.shape
    b = qh.view(NB, chunks, 16, 4)  # [nb, chunk, c, i]
    fifth = torch.stack([(b >> j) & 1 for j in range(8)], dim=3)  # [nb, chunk, c, j, i]
    return unpack_int4_x86(qpack) | (fifth.permute(0, 2, 1, 3, 4).reshape(NB * 16, chunks * 32) << 4)


def pack_q6k_x86(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q6_K tensor's parts as they are (``runtime.gguf_blocks.q6_k_blocks``): codes q (N, K)
    in [-32, 31], each 256-input block's d (N, K/256), each 16-input group's int8 scale (N, K/16)
    -> (qpack (N/16, K/8, 64) uint8: the low 4 bits of u = q + 32 in pack_int4_x86's layout,
    qh (N/16, K/16, 64) uint8: u's high 2 bits, byte 4 c + i of input chunk P holding those of
    inputs 16 P + 4 j + i in bits 2 j and 2 j + 1, kd (N/16, K/256, 16) float32, km (N/16, K/16, 16)
    int8): the arguments of ``int4_gemm_q6k``, whose weight is w = (d * sc) * u - 32 * (d * sc).
    N must be a multiple of 16, K of 256."""
    N, K = q.shape
    if N % 16 or K % 256 or d.shape != (N, K // 256) or sc.shape != (N, K // 16):
        raise ValueError(f"pack_q6k_x86 needs N % 16 == 0, K % 256 == 0, d (N, K/256) and scales (N, K/16); got "
                         f"codes {tuple(q.shape)}, d {tuple(d.shape)}, scales {tuple(sc.shape)}")
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    high = (u >> 4).view(N // 16, 16, K // 16, 4, 4)  # [nb, c, chunk, j, i]
    byte = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    qh = byte.permute(0, 2, 1, 3).reshape(N // 16, K // 16, 64).contiguous()

    def by_block(v: torch.Tensor) -> torch.Tensor:  # (N, G) -> (N/16, G, 16)
        return v.reshape(N // 16, 16, -1).permute(0, 2, 1).contiguous()

    return _pack_codes(u & 15), qh, by_block(d.float()), by_block(sc.to(torch.int8))


def unpack_q6k_x86(qpack: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """The codes q (N, K) int8 in [-32, 31] of a packed Q6_K weight (pack_q6k_x86's inverse)."""
    NB, chunks, _ = qh.shape
    b = qh.view(NB, chunks, 16, 4)  # [nb, chunk, c, i]
    high = torch.stack([(b >> (2 * j)) & 3 for j in range(4)], dim=3)  # [nb, chunk, c, j, i]
    high = high.permute(0, 2, 1, 3, 4).reshape(NB * 16, chunks * 16)
    return ((unpack_int4_x86(qpack) | (high << 4)).to(torch.int16) - 32).to(torch.int8)


def unpack_int4_x86(qpack: torch.Tensor) -> torch.Tensor:
    """The codes q (N, K) uint8 of a packed weight (pack_int4_x86's inverse)."""
    NB, octets, _ = qpack.shape
    b = qpack.view(NB, octets, 16, 4)  # [nb, octet, c, i]
    q = torch.stack([b & 15, b >> 4], dim=3)  # [nb, octet, c, half, i]
    return q.permute(0, 2, 1, 3, 4).reshape(NB * 16, octets * 8)


def dequantize_int4_x86(qpack: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """The (N, K) matrix a packed weight stands for (w = q * scale + offset, in ``dtype``), or only
    its ``rows`` (R,) (long; any order), 4,096 rows at a time (bounded temporaries)."""
    NB, octets, _ = qpack.shape
    G = scales.shape[1]
    if rows is None:
        rows = torch.arange(NB * 16)
    out = torch.empty(rows.numel(), octets * 8, dtype=dtype)
    codes = qpack.view(NB, octets, 16, 4)  # [nb, octet, c, i]
    sz = scales.view(NB, G, 2, 16)
    for a in range(0, rows.numel(), 4096):
        r = rows[a:a + 4096]
        b, c = r // 16, r % 16
        byte = codes[b, :, c]  # (R, octets, 4)
        q = torch.stack([byte & 15, byte >> 4], dim=2).reshape(r.numel(), G, -1)  # (R, G, K/G)
        s, o = sz[b, :, 0, c].float(), sz[b, :, 1, c].float()  # (R, G) each
        out[a:a + 4096] = (q.float() * s[..., None] + o[..., None]).view(r.numel(), -1).to(dtype)
    return out
