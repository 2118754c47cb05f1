"""A native model that runs a GGUF file's own blocks, saved once, read back in seconds.

``target_quant="gguf"`` builds the int4 native model, then reads the GGUF file and replaces the
layers whose tensor there is of a type it runs as it is (``store.gguf_linears``): ~13 s for the
1.5B model. The first such load of a file on a machine saves the result (one safetensors file
under ``$SPECULANT_CACHE/native/``, beside the int4 model of ``native_store``), and later loads read
it back without reading the GGUF's blocks or building the int4 model. The embedding table is
mapped from the file, as in ``native_store``.

Each linear layer is saved with its kind in the metadata (``int4``: speculant's int4 layer;
``Q4_K``, ``Q8_0``, ...: a ``runtime.block_linear.BlockLinear`` of that GGUF type) and its packed
tensors (an int4 layer's ``qweight`` and ``scales``, a block layer's :meth:`~BlockLinear.parts`),
plus its float32 bias. A joined q/k/v or gate/up layer is saved once, its parts read back as its
rows. The metadata also names the format and version, the packed layout (``x86``), the group size
and the report of the replacement (what the load prints); the file's name says the layout and
version too, and carries the sizes and times of the GGUF file and of the converted model's weight
files, so a changed source is another file. It is never confused with an int4 model's file
(``-gguf-`` in its name where that has ``-int4-``; another format in its metadata).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .native_model import PROJECTIONS
from .native_store import NORMS, assemble, norm_tensors, read_saved, source_digest, write_atomically

__all__ = ["gguf_store_path", "load_gguf_store", "save_gguf_store", "storable"]

FORMAT, VERSION = "speculant-native-gguf", "1"
_JOINED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def gguf_store_path(source: Path, files: list[Path], gguf: Path, quant_head: bool, kind: str, group: int) -> Path:
    """Where the model converted to ``source`` (its weight ``files``) with the layers of ``gguf``'s
    own blocks is kept."""
    from ..runtime.process import cache_dir

    name = (f"{source.name}-{source_digest(source, files, (gguf,))}-gguf-{kind}-g{group}"
            f"{'-head' if quant_head else ''}-v{VERSION}.safetensors")
    return cache_dir() / "native" / name


def _layer_kind(layer: nn.Module) -> str | None:
    """How a linear layer is saved: "int4" (speculant's int4 layout), its GGUF type (a block
    layer), or None (a layer this file does not hold)."""
    from ..runtime.block_linear import BlockLinear
    from ..runtime.quant import Int4Linear

    if isinstance(layer, BlockLinear):
        return layer.kind
    if isinstance(layer, Int4Linear) and layer.kind == "x86":
        return "int4"
    return None


def storable(model) -> bool:
    """Whether every linear layer of ``model`` (a NativeModel) is one this file holds: int4 of
    speculant's layout or a GGUF file's blocks (the output layer may also be dense or tied)."""
    layers = [getattr(blk, n) for blk in model.blocks for n in PROJECTIONS]
    return all(_layer_kind(lin) is not None for lin in layers) and (
        _layer_kind(model.lm_head) is not None or type(model.lm_head) is nn.Linear)


def _layer_tensors(prefix: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``layer`` is made of, named under ``prefix`` (empty ones left out)."""
    from ..runtime.block_linear import BlockLinear

    parts = layer.parts() if isinstance(layer, BlockLinear) else {"qweight": layer.qweight,
                                                                    "scales": layer.scales_zeros}
    if layer.bias32.numel():
        parts = {**parts, "bias": layer.bias32}
    return {f"{prefix}.{name}": t.contiguous() for name, t in parts.items() if t.numel()}


def save_gguf_store(model, path: Path, kind: str, group: int, quant_head: bool, report: dict[str, Any]) -> None:
    """Write ``model`` (a NativeModel of int4 layers of ``kind`` and block layers: :func:`storable`)
    to ``path``, atomically (a temporary file renamed into place); ``report``: what
    ``apply_gguf_blocks`` returned for it."""
    if not storable(model):
        raise ValueError("save_gguf_store holds int4 layers of speculant's layout and GGUF block layers only")
    t: dict[str, torch.Tensor] = {"embed": model.embed.contiguous(), "norm": model.norm.contiguous()}
    layers = []
    for i, blk in enumerate(model.blocks):
        p = f"layers.{i}."
        t.update(norm_tensors(blk, p))
        # a joined layer once (its parts are its rows), else each part
        names = [n for joined, parts in _JOINED.items()
                 for n in ((joined,) if getattr(blk, joined) is not None else parts)] + ["o_proj", "down_proj"]
        for name in names:
            t.update(_layer_tensors(p + name, getattr(blk, name)))
        layers.append({name: _layer_kind(getattr(blk, name)) for name in names})
    head = model.lm_head
    head_kind = _layer_kind(head)
    if head_kind is not None:
        t.update(_layer_tensors("lm_head", head))
    elif head.weight.data_ptr() == model.embed.data_ptr():
        head_kind = "tied"
    else:
        head_kind, t["lm_head.weight"] = "dense", head.weight.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "kind": kind, "group": str(group), "quant_head": str(quant_head),
            "layers": json.dumps(layers), "head": head_kind, "widths": json.dumps([blk.widths for blk in model.blocks]),
            "report": json.dumps(report)}
    write_atomically(path, t, meta)


def _make_layer(kind: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype, group: int) -> nn.Module:
    """The layer of ``kind`` (:func:`_layer_kind`'s) made of its saved ``tensors``."""
    from ..runtime.block_quant import BlockQuantLinear
    from ..runtime.kquant import KINDS, KQuantLinear
    from ..runtime.quant import Int4Linear
    from ..runtime.gguf_blocks import LEGACY

    bias = tensors.pop("bias", None)
    if kind == "int4":
        q = tensors["qweight"]
        return Int4Linear.from_packed(q, tensors["scales"], bias, "x86", q.shape[1] * 8, dtype, group)
    if kind in KINDS:
        layer = KQuantLinear(tensors["qweight"], tensors["kd"], tensors["km"], bias, dtype,
                             tensors["qh"] if kind != "Q4_K" else None)
    elif kind in LEGACY:
        layer = BlockQuantLinear(kind, tensors, bias, dtype)
    else:
        raise ValueError(f"a layer of unknown kind {kind!r}")
    if layer.kind != kind:
        raise ValueError(f"a {kind} layer whose tensors are {layer.kind}'s")
    return layer


def load_gguf_store(path: Path, cfg, generation_config, dtype: torch.dtype, quiet: bool = False):
    """(the NativeModel saved at ``path``, the report saved with it), or None if the file is
    missing or not of this format and version. A file that cannot be read (e.g. truncated) is
    named on standard error, unless ``quiet``."""
    parts = read_saved(path, FORMAT, VERSION, "gguf-block model", lambda *a: _read_blocks(*a, cfg, dtype), quiet)
    if parts is None:
        return None
    *model_parts, report = parts
    return assemble(path, cfg, generation_config, *model_parts, "gguf"), report


def _read_blocks(meta: dict, keys: set, get: Callable, cfg, dtype: torch.dtype) -> tuple:
    """A gguf-block file's blocks, final norm, output layer (None: dense or tied), dense output
    weight and report."""
    from .native_model import NativeBlock

    group = int(meta["group"])

    def layer(prefix: str, kind: str) -> nn.Module:
        mine = {k[len(prefix) + 1:]: get(k) for k in keys if k.startswith(prefix + ".")}
        return _make_layer(kind, mine, dtype, group)

    layers, widths = json.loads(meta["layers"]), json.loads(meta["widths"])
    if len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"{len(layers)} layers saved, the model has {cfg.num_hidden_layers}")
    blocks = []
    for i, (kinds, (wq, wk, wv)) in enumerate(zip(layers, widths)):
        p = f"layers.{i}."
        proj = {name: layer(p + name, k) for name, k in kinds.items() if name not in _JOINED}
        joined = {name: layer(p + name, kinds[name]) if name in kinds else None for name in _JOINED}
        if joined["qkv"] is not None:
            proj.update(q_proj=joined["qkv"].rows(0, wq), k_proj=joined["qkv"].rows(wq, wq + wk),
                        v_proj=joined["qkv"].rows(wq + wk, wq + wk + wv))
        if joined["gate_up"] is not None:
            half = joined["gate_up"].out_features // 2
            proj.update(gate_proj=joined["gate_up"].rows(0, half), up_proj=joined["gate_up"].rows(half, 2 * half))
        missing = [n for n in PROJECTIONS if n not in proj]
        if missing:
            raise ValueError(f"layer {i} lacks {', '.join(missing)}")
        extra = {n: get(p + n) if p + n in keys else None for n in NORMS}
        blocks.append(NativeBlock(get(p + "in_norm"), get(p + "post_norm"), proj, qkv=joined["qkv"],
                                  gate_up=joined["gate_up"], **extra))
    head_kind = meta["head"]
    head = None if head_kind in ("tied", "dense") else layer("lm_head", head_kind)
    head_w = get("lm_head.weight") if head_kind == "dense" else None
    return blocks, get("norm"), head, head_w, json.loads(meta["report"])
