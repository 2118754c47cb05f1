"""A user's GGUF file as it is: the native model's linear layers whose tensor in the file is Q4_K
Q5_K or Q6_K (the output layer included) run the file's own codes and scales
(``runtime.kquant.KQuantLinear``) instead of speculant's int4 quantization of their de-quantized
weights.

The model is loaded as usual first (``NativeModel`` with int4 layers, from the file's conversion);
each projection is then matched to its GGUF tensor by gguf-py's tensor name map for the file's
architecture. Before a layer is replaced, the file's rows are checked against the loaded layer's
(the first 256 rows, de-quantized both ways): in the file's order, or in the order llama.cpp's
converter permuted the query and key rows into (``permuted_rows``), whichever matches; a tensor
that matches neither is left as it was, with the reason in the report. Tensors of other types
(Q4_0, Q5_0, Q8_0, ...) keep speculant's int4 layers for now.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..backends.native_model import _PROJ
from ..errors import ModelLoadError

__all__ = ["apply_gguf_blocks", "permuted_rows", "source_gguf"]

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
    """Replace ``model``'s (a NativeModel) linear layers whose tensor in ``gguf`` is Q4_K, Q5_K or
    Q6_K by the file's own blocks; returns a report: ``q4_k``, ``q5_k`` and ``q6_k`` (layers replaced), ``kept`` (GGUF
    type -> layers left as they were) and ``mismatched`` (tensors whose rows matched neither order)."""
    import gguf as gg
    from gguf import GGMLQuantizationType, GGUFReader

    from ..runtime.kquant import KQuantLinear
    from ..runtime.quant import Int4Linear
    from .gguf_blocks import dequantize_q4_k, dequantize_q5_k, dequantize_q6_k
    from .gguf_meta import _value

    reader = GGUFReader(str(gguf))
    arch_name = _value(reader, "general.architecture")
    arch = {v: k for k, v in gg.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        raise ModelLoadError(f"{gguf}: gguf-py does not know the architecture {arch_name!r}; load it with "
                             "target_quant int4")
    names = gg.get_tensor_name_map(arch, len(model.blocks))
    tensors = {t.name: t for t in reader.tensors}
    heads = {"q_proj": model.heads, "k_proj": model.kv_heads}
    report: dict[str, Any] = {"q4_k": 0, "q5_k": 0, "q6_k": 0, "kept": {}, "mismatched": []}
    dequantize = {GGMLQuantizationType.Q4_K: dequantize_q4_k, GGMLQuantizationType.Q5_K: dequantize_q5_k,
                  GGMLQuantizationType.Q6_K: dequantize_q6_k}

    def replacement(hf_name: str, layer, proj: str):
        t = tensors.get(f"{names.get_name(hf_name)}.weight")
        if t is None or not isinstance(layer, Int4Linear) or layer.kind != "x86":
            return None
        if t.tensor_type not in dequantize:
            report["kept"][t.tensor_type.name] = report["kept"].get(t.tensor_type.name, 0) + 1
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
            mine = torch.from_numpy(dequantize[t.tensor_type](raw[rows]))
            if (mine - loaded).norm() <= _MATCH * loaded.norm():
                bias = layer.bias32 if layer.bias32.numel() else None
                report[t.tensor_type.name.lower()] += 1
                return KQuantLinear.from_blocks(raw, bias, order, model.dtype, t.tensor_type.name)
        report["mismatched"].append(f"{t.name}: its rows match the loaded layer's in no known order")
        return None

    for i, block in enumerate(model.blocks):
        new = {}
        for proj in _PROJ:
            part = "self_attn" if proj in _PROJ[:4] else "mlp"
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


def _join(block, parts: tuple[str, ...], joined: str, new: dict) -> None:
    """Re-join the block's ``parts`` into ``joined`` where any of them was replaced: one k-quant
    layer when all of them are of one type, else none (each runs on its own)."""
    from ..runtime.kquant import KQuantLinear

    if not any(p in new for p in parts):
        return
    layers = [getattr(block, p) for p in parts]
    same = all(isinstance(l, KQuantLinear) for l in layers) and len({l.kind for l in layers}) == 1
    setattr(block, joined, KQuantLinear.concat(layers) if same else None)
