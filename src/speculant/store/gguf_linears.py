"""A user's GGUF file as it is: the native model's linear layers whose tensor in the file is Q4_K,
Q5_K or Q6_K (``runtime.kquant.KQuantLinear``), or Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0
(``runtime.block_quant.BlockQuantLinear``), the output layer included, run the file's own codes and
scales instead of speculant's int4 quantization of their de-quantized weights.

The model is loaded as usual first (``NativeModel`` with int4 layers, from the file's conversion);
each projection is then matched to its GGUF tensor by gguf-py's tensor name map for the file's
architecture. Before a layer is replaced, the file's rows are checked against the loaded layer's
(the first 256 rows, de-quantized both ways): in the file's order, or in the order llama.cpp's
converter permuted the query and key rows into (``permuted_rows``), whichever matches; a tensor
that matches neither is left as it was, with the reason in the report. Tensors of other types
(F16, BF16, Q2_K, Q3_K, the i-quants) keep speculant's int4 layers, counted in the report's ``kept``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..backends.native_model import PROJECTIONS
from ..errors import ModelLoadError
from ..runtime.kquant import KINDS
from ..runtime.gguf_blocks import LEGACY

__all__ = ["RUNS", "apply_gguf_blocks", "permuted_rows", "source_gguf"]

# the GGUF types whose blocks run as they are: the k-quants (KQuantLinear) and the 32-weight types
# (BlockQuantLinear)
RUNS = KINDS + tuple(LEGACY)

_CHECK_ROWS = 256
_MATCH = 0.25  # relative difference of the file's rows and the loaded (re-quantized) rows that counts as the same


def permuted_rows(n: int, heads: int) -> np.ndarray:
    """The file row of each model row of a query or key projection (n rows, ``heads`` heads) that
    llama.cpp's converter wrote in its rotary order: within each head, the rows of the two halves
    of the rotation interleaved (row 2i + j of the file is row j * half + i of the head)."""
    half = n // heads // 2
    model = np.arange(n).reshape(heads, 2, half)  # [head, j, i]: the model's row
    file_of = np.empty(n, dtype=np.int64)
    file_of[model.transpose(0, 2, 1).reshape(-1)] = np.arange(n)  # the file holds them as [head, i, j]
    return file_of


def source_gguf(spec: str | os.PathLike):
    """The GGUF file behind a model spec (``models.gguf_path``: a preset's, a ``.gguf`` path, or the
    one a cache directory was converted from), or a clear error where there is none."""
    from .models import gguf_path

    path = gguf_path(spec)
    if path is None:
        raise ModelLoadError(f"{spec} is not a GGUF file or a preset: the file's own blocks (gguf) need one; "
                             "use int4 for a transformers model directory")
    return path


def apply_gguf_blocks(model, gguf: str | os.PathLike) -> dict[str, Any]:
    """Replace ``model``'s (a NativeModel) linear layers whose tensor in ``gguf`` is of a type in
    :data:`RUNS` by the file's own blocks; returns a report: the layers replaced per type (``q4_k``,
    ``q8_0``, ...: every type of :data:`RUNS`), ``kept`` (GGUF type -> layers left as they were) and
    ``mismatched`` (tensors whose rows matched neither order)."""
    import gguf as gg
    from gguf import GGUFReader

    from ..runtime.quant import Int4Linear
    from .gguf_meta import meta_value

    reader = GGUFReader(str(gguf))
    arch_name = meta_value(reader, "general.architecture")
    arch = {v: k for k, v in gg.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        raise ModelLoadError(f"{gguf}: gguf-py does not know the architecture {arch_name!r}; load it with "
                             "target_quant int4")
    names = gg.get_tensor_name_map(arch, len(model.blocks))
    tensors = {t.name: t for t in reader.tensors}
    heads = {"q_proj": model.heads, "k_proj": model.kv_heads}
    report: dict[str, Any] = {**{kind.lower(): 0 for kind in RUNS}, "kept": {}, "mismatched": []}

    def replacement(hf_name: str, layer, proj: str):
        t = tensors.get(f"{names.get_name(hf_name)}.weight")
        if t is None or not isinstance(layer, Int4Linear) or layer.kind != "x86":
            return None
        kind = t.tensor_type.name
        if kind not in RUNS:
            report["kept"][kind] = report["kept"].get(kind, 0) + 1
            return None
        raw = np.asarray(t.data)
        n = raw.shape[0]
        if n != layer.out_features or int(t.shape[0]) != layer.in_features:
            report["mismatched"].append(f"{t.name}: shape {n} x {int(t.shape[0])}, the model's "
                                        f"{layer.out_features} x {layer.in_features}")
            return None
        check = min(n, _CHECK_ROWS)
        loaded = layer.dequantize_rows(torch.arange(check)).float()
        orders = [None] + ([permuted_rows(n, heads[proj])] if proj in heads else [])
        for order in orders:
            rows = np.arange(check) if order is None else order[:check]
            mine = torch.from_numpy(_dequantize(raw[rows], kind))
            if (mine - loaded).norm() <= _MATCH * loaded.norm():
                bias = layer.bias32 if layer.bias32.numel() else None
                report[kind.lower()] += 1
                return _layer_class(kind).from_blocks(raw, bias, order, model.dtype, kind)
        report["mismatched"].append(f"{t.name}: its rows match the loaded layer's in no known order")
        return None

    for i, block in enumerate(model.blocks):
        new = {}
        for proj in PROJECTIONS:
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            layer = replacement(f"model.layers.{i}.{part}.{proj}", getattr(block, proj), proj)
            if layer is not None:
                new[proj] = layer
        for proj, layer in new.items():
            setattr(block, proj, layer)
        _join(block, ("q_proj", "k_proj", "v_proj"), "qkv", new)
        _join(block, ("gate_proj", "up_proj"), "gate_up", new)
    head = replacement("lm_head", model.lm_head, "lm_head")
    if head is not None:
        model.lm_head = head
    return report


def _layer_class(kind: str):
    """The layer that runs a GGUF ``kind`` of :data:`RUNS` as it is."""
    from ..runtime.block_quant import BlockQuantLinear
    from ..runtime.kquant import KQuantLinear

    return KQuantLinear if kind in KINDS else BlockQuantLinear


def _dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """The float32 weights (N, K) of a ``kind`` tensor's raw bytes."""
    from ..runtime.gguf_blocks import dequantize_legacy, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k

    if kind not in KINDS:
        return dequantize_legacy(raw, kind)
    return {"Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}[kind](raw)


def _join(block, parts: tuple[str, ...], joined: str, new: dict) -> None:
    """Re-join the block's ``parts`` into ``joined`` where any of them was replaced: one layer of
    the file's blocks when all of them are of one type, else none (each runs on its own)."""
    from ..runtime.block_linear import BlockLinear

    if not any(p in new for p in parts):
        return
    layers = [getattr(block, p) for p in parts]
    same = all(isinstance(lin, BlockLinear) for lin in layers) and len({lin.kind for lin in layers}) == 1
    setattr(block, joined, type(layers[0]).concat(layers) if same else None)
