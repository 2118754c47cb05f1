"""The runtime a model runs on when the user leaves it to speculant: chosen before the target
loads, from its config alone (the rest of what runs is decided once it has loaded:
:func:`speculant.planning.plan`).

Models of the native runtime's families (``backends.native_arch``) in bf16 run on it wherever
speculant's kernels run (every x86-64 CPU with a C++ compiler: its AMX, AVX-512 VNNI, AVX2 or
portable path). A model that comes from a GGUF file (a preset, a ``.gguf`` path) runs the file's
own blocks (``target_quant="gguf"``: its Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 layers as
they are, the output layer included), so the model decoded is the one the user chose; other
models, and a GGUF model with a LoRA adapter merged into its weights, are quantized to int4. Either
way the passes are row-invariant, so speculative output equals plain output bit for bit. Other
architectures (and float32) run on transformers. :func:`resolve_runtime` turns a
``DecoderConfig``'s "auto" backend and quantization into these choices. Why each default is what
it is: docs/design-notes.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DecoderConfig
from .backends.native_arch import SUPPORTED, native_refusal

__all__ = ["Runtime", "choose_runtime", "int4_fits", "int4_kernel_name", "resolve_runtime"]


@dataclass(frozen=True)
class Runtime:
    backend: str  # "hf" | "native"
    target_quant: str  # "none" | "int8" | "int4" | "gguf"
    quant_head: bool
    why: str  # one plain sentence


def _config(target) -> dict:
    """The model config (as a dict) of a spec or LoadedModel, without loading weights; {} if unknown."""
    from .store.models import LoadedModel, resolve

    if isinstance(target, LoadedModel):
        cfg = target.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    try:
        path = resolve(target, torch.bfloat16)
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def int4_fits(cfg: dict) -> bool:
    """Whether every linear layer of a model with config ``cfg`` takes speculant's int4 layout
    (inputs in groups of 64, outputs in blocks of 16)."""
    H, F = cfg.get("hidden_size", 0), cfg.get("intermediate_size", 0)
    heads = cfg.get("num_attention_heads", 0) or 1
    D = cfg.get("head_dim") or H // heads
    kv = cfg.get("num_key_value_heads") or heads
    return bool(H and F) and H % 64 == 0 and F % 64 == 0 and (heads * D) % 64 == 0 and (kv * D) % 16 == 0


def int4_kernel_name() -> str | None:
    """Which code path of speculant's int4 kernel runs here ("AVX-512 VNNI", "AVX2", ...), or None."""
    from .kernels import int4_isa

    isa = int4_isa()
    return None if isa is None else {"amx": "AMX + AVX-512 VNNI", "avx512-vnni": "AVX-512 VNNI",
                                     "avx2-vnni": "AVX2 + AVX-VNNI", "avx2": "AVX2", "portable": "portable C++"}[isa]


def choose_runtime(target, dtype, backend: str = "auto", target_quant: str = "auto",
                   quant_head: bool | None = None, adapted: bool = False) -> Runtime:
    """Resolve "auto" backend / target quantization / output-layer quantization for ``target``
    (``adapted``: a LoRA adapter is merged into its weights, so they are not a GGUF file's)."""
    from .backends.native_model import NativeModel
    from .store.models import LoadedModel, has_gguf_source, parse_dtype

    dtype = target.dtype if isinstance(target, LoadedModel) else parse_dtype(dtype)  # a loaded model's own
    cfg = _config(target) if backend == "auto" or target_quant == "auto" else {}
    arch = cfg.get("model_type")
    kernel = int4_kernel_name()
    why = ""
    if backend == "auto":
        refusal = native_refusal(cfg) if arch in SUPPORTED else None
        if arch not in SUPPORTED:
            backend, why = "hf", (f"transformers runs {arch or 'this model'} (speculant's native runtime covers "
                                  f"{', '.join(SUPPORTED)} models)")
        elif refusal:
            backend, why = "hf", f"transformers runs it ({refusal})"
        elif dtype != torch.bfloat16 or kernel is None or not int4_fits(cfg):
            backend = "hf"
            why = ("transformers runs it in float32 (the native int4 runtime needs bfloat16)" if dtype != torch.bfloat16
                   else "transformers runs it (no C++ compiler for speculant's int4 kernel here)" if kernel is None
                   else "transformers runs it (its layer sizes do not fit the int4 layout: multiples of 64)")
        else:
            backend = "native"
    if target_quant == "auto":
        fits = int4_fits(cfg) if cfg else True
        if isinstance(target, LoadedModel) and isinstance(target.model, NativeModel):
            target_quant = target.model.quant  # loaded for the native runtime already: as it was loaded
        elif not (backend == "native" and dtype == torch.bfloat16 and kernel is not None and fits):
            target_quant = "none"
        elif not adapted and not isinstance(target, LoadedModel) and has_gguf_source(target):
            target_quant = "gguf"  # the file's own blocks: the model the user chose
        else:
            target_quant = "int4"  # a transformers model (given, or a directory), or adapted weights
    if quant_head is None:
        quant_head = target_quant != "none"
    if backend == "native" and not why:
        what = f"int4 weights ({kernel} kernel)" if target_quant == "int4" else \
            ("the GGUF file's own blocks (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as they are, "
             f"int4 for layers of other types ({kernel} kernel)") \
            if target_quant == "gguf" else f"{target_quant} weights" \
            if target_quant != "none" else str(dtype).removeprefix("torch.") + " weights"
        head = ", output layer included" if quant_head and target_quant != "none" else ""
        why = f"speculant's native runtime, {what}{head}"
    return Runtime(backend, target_quant, bool(quant_head), why)


def resolve_runtime(config: DecoderConfig) -> tuple[DecoderConfig, Runtime]:
    """``config`` with its "auto" backend, target quantization and output-layer quantization
    chosen for this machine and model (checked again as a whole), and the :class:`Runtime` saying
    why."""
    rt = choose_runtime(config.target, config.dtype, config.backend, config.target_quant, config.quant_head,
                        adapted=config.lora is not None)
    return dataclasses.replace(config, backend=rt.backend, target_quant=rt.target_quant,
                               quant_head=rt.quant_head), rt
