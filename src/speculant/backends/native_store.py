"""A native int4 model saved once, read back in seconds.

Quantizing a model's bf16 weights to int4 takes a while, and reading them through their dense
copies makes the process peak far above the final model. So the first
``NativeModel.from_dir(..., quant="int4")`` of a model on a machine saves the packed result (one
safetensors file under ``$SPECULANT_CACHE/native/``), and later loads read it back in about a
second (docs/design-notes.md#int4-model-saved-once-per-machine). The embedding table is
mapped from the file, not read: only the rows of the tokens actually seen become resident.

The file holds each layer's norms, its joined q/k/v and gate/up layers and its o/down layers
(codes, scales, float32 biases), the output layer (int4, or bf16 without ``quant_head``), the
final norm and the embedding, plus metadata naming the format, the packed layout (``x86``: the
kernel it was packed for), the group size and the source. The name of the file says all of that
too, and the source directory's file sizes and times, so a changed source or another layout is
another file: a file of the former ``amx`` layout (``-int4-amx-`` in its name, saved on AMX CPUs
by earlier versions) is never read, an ``x86`` one is made beside it. The model that runs a GGUF
file's own blocks (``target_quant="gguf"``) is saved beside it by ``native_gguf_store``, written
the same way.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import nn

__all__ = ["store_path", "save_store", "load_store", "read_saved", "remove_partial_saves", "write_atomically"]

FORMAT, VERSION = "speculant-native-int4", "1"
_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8, "F16": torch.float16, "I8": torch.int8}

T = TypeVar("T")  # what a saved file is read into

NORMS = ("q_norm", "k_norm", "attn_out_norm", "ffn_out_norm")  # a block's norms that some families have


def source_digest(source: Path, files: list[Path], also: tuple[Path, ...] = ()) -> str:
    """12 hex digits naming the model directory ``source`` with the sizes and times of its weight
    ``files`` (by name) and of the files ``also`` (by full path): another source, another digest."""
    ident = "|".join([str(source.resolve())]
                     + [f"{a.resolve()}:{a.stat().st_size}:{a.stat().st_mtime_ns}" for a in also]
                     + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files])
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def store_path(source: Path, files: list[Path], quant_head: bool, kind: str, group: int) -> Path:
    """Where the int4 form of the model in ``source`` (its weight ``files``) is kept."""
    from ..runtime.process import cache_dir

    name = (f"{source.name}-{source_digest(source, files)}-int4-{kind}-g{group}{'-head' if quant_head else ''}"
            f"-v{VERSION}.safetensors")
    return cache_dir() / "native" / name


def norm_tensors(blk, prefix: str) -> dict[str, torch.Tensor]:
    """A block's norms as saved, named under ``prefix`` (``layers.{i}.``): those it has of :data:`NORMS` too."""
    t = {prefix + "in_norm": blk.in_norm.contiguous(), prefix + "post_norm": blk.post_norm.contiguous()}
    t.update({prefix + n: getattr(blk, n).contiguous() for n in NORMS if getattr(blk, n) is not None})
    return t


def save_store(model, path: Path, kind: str, group: int, quant_head: bool) -> None:
    """Write ``model`` (a NativeModel whose layers are joined int4 layers of ``kind``) to ``path``,
    atomically (a temporary file renamed into place)."""
    t: dict[str, torch.Tensor] = {"embed": model.embed.contiguous(), "norm": model.norm.contiguous()}
    for i, blk in enumerate(model.blocks):
        t.update(norm_tensors(blk, f"layers.{i}."))
        for name, layer in (("qkv", blk.qkv), ("o_proj", blk.o_proj), ("gate_up", blk.gate_up),
                            ("down_proj", blk.down_proj)):
            t[f"layers.{i}.{name}.qweight"] = layer.qweight.contiguous()
            t[f"layers.{i}.{name}.scales"] = layer.scales_zeros.contiguous()
            if layer.bias32.numel():
                t[f"layers.{i}.{name}.bias"] = layer.bias32.contiguous()
    head = model.lm_head
    tied = head.weight is not None and head.weight.data_ptr() == model.embed.data_ptr()  # dense or LinearWeights
    if quant_head:
        t["lm_head.qweight"], t["lm_head.scales"] = head.qweight.contiguous(), head.scales_zeros.contiguous()
    elif not tied:
        t["lm_head.weight"] = head.weight.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "kind": kind, "group": str(group), "quant_head": str(quant_head),
            "tied": str(tied), "widths": json.dumps([blk.widths for blk in model.blocks])}
    write_atomically(path, t, meta)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` and ``metadata`` at ``path``, written under a temporary
    name (``remove_partial_saves`` finds those a killed save left) and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_partial_saves(path: Path, what: str = "int4 model") -> None:
    """Delete the temporary files that killed saves of ``path`` (the ``what``) left (call it
    holding the lock that every save of ``path`` holds: no live save has one then). They are
    never read."""
    for left in sorted(path.parent.glob(f".{path.name}.*.tmp")):
        print(f"speculant: removing {left}, left by an interrupted save of the {what}", file=sys.stderr, flush=True)
        left.unlink(missing_ok=True)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format (8-byte header length, JSON header, then the data), written one tensor
    at a time: ``safetensors.torch.save_file`` first turns every tensor into bytes, which would
    hold a second copy of the whole model in memory while it writes."""
    names = {v: k for k, v in _DTYPES.items()}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))


def _mapped(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file as a copy-on-write mapping of the file: its pages are
    read when touched (an embedding table: only the rows looked up)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    entry = header[name]
    a, b = entry["data_offsets"]
    dtype = _DTYPES[entry["dtype"]]
    count = (b - a) // torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + a).view(entry["shape"])


def read_saved(path: Path, fmt: str, version: str, what: str, read: Callable[[dict, set, Callable], T],
               quiet: bool = False) -> T | None:
    """``read(metadata, tensor names, get_tensor)`` over the safetensors file saved at ``path``, or
    None if the file is missing or its metadata names another format than ``fmt`` at ``version``.
    A file ``read`` fails on (e.g. truncated) gives None too, and is named on standard error as the
    saved ``what`` ("int4 model") that is rebuilt, unless ``quiet``."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != fmt or meta.get("version") != version:
                return None
            return read(meta, set(f.keys()), f.get_tensor)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: rebuild it
        if not quiet:
            print(f"speculant: ignoring the saved {what} {path} ({type(e).__name__}: {e}); rebuilding it",
                  file=sys.stderr, flush=True)
        return None


def load_store(path: Path, cfg, generation_config, dtype: torch.dtype, quiet: bool = False):
    """The NativeModel saved at ``path``, or None if the file is missing or not one of ours. A file
    that cannot be read (e.g. truncated) is named on standard error, unless ``quiet``."""
    parts = read_saved(path, FORMAT, VERSION, "int4 model", lambda *a: _read_int4(*a, cfg, dtype), quiet)
    return None if parts is None else assemble(path, cfg, generation_config, *parts, "int4")


def _read_int4(meta: dict, keys: set, get: Callable, cfg, dtype: torch.dtype) -> tuple:
    """An int4 file's blocks, final norm, output layer (None: dense or tied) and dense output weight."""
    from ..runtime.quant import Int4Linear
    from .native_model import NativeBlock

    kind, group = meta["kind"], int(meta["group"])

    def layer(prefix: str, k: int) -> Int4Linear:
        bias = get(prefix + ".bias") if prefix + ".bias" in keys else None
        return Int4Linear.from_packed(get(prefix + ".qweight"), get(prefix + ".scales"), bias, kind, k, dtype, group)

    H, F = cfg.hidden_size, cfg.intermediate_size
    blocks = []
    for i, widths in enumerate(json.loads(meta["widths"])):
        p = f"layers.{i}."
        qkv, gate_up = layer(p + "qkv", H), layer(p + "gate_up", H)
        a, b = widths[0], widths[0] + widths[1]
        proj = {"q_proj": qkv.rows(0, a), "k_proj": qkv.rows(a, b), "v_proj": qkv.rows(b, b + widths[2]),
                "o_proj": layer(p + "o_proj", widths[0]), "gate_proj": gate_up.rows(0, F),
                "up_proj": gate_up.rows(F, 2 * F), "down_proj": layer(p + "down_proj", F)}
        extra = {n: get(p + n) if p + n in keys else None for n in NORMS}
        blocks.append(NativeBlock(get(p + "in_norm"), get(p + "post_norm"), proj, qkv=qkv, gate_up=gate_up, **extra))
    head_w = get("lm_head.weight") if "lm_head.weight" in keys else None
    head = layer("lm_head", H) if "lm_head.qweight" in keys else None
    return blocks, get("norm"), head, head_w


def assemble(path: Path, cfg, generation_config, blocks: list, norm: torch.Tensor, head: nn.Module | None,
             head_w: torch.Tensor | None, quant: str):
    """The NativeModel of a saved file's parts, its embedding mapped from ``path``. ``head`` None:
    the output layer is the dense ``head_w``, or the embedding itself (tied) without one."""
    from .native_model import NativeModel

    embed = _mapped(path, "embed")
    if head is None:
        head = nn.Linear(cfg.hidden_size, embed.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(head_w if head_w is not None else embed, requires_grad=False)
    model = NativeModel(cfg, embed, blocks, norm, head, generation_config, quant)
    model.requires_grad_(False)
    return model.eval()
