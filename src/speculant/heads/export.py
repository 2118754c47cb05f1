"""Medusa heads written for other engines.

``medusa``: the layout of the Medusa reference code (FasterDecoding/Medusa) — a directory with

    config.json                   {"medusa_num_heads": K, "medusa_num_layers": n,
                                   "base_model_name_or_path": the target's transformers directory, ...}
    medusa_lm_head.safetensors    "{k}.{j}.linear.weight" (H, H), "{k}.{j}.linear.bias" (H,)   j < n
                                  "{k}.{n}.weight" (V, H)   every head's own vocabulary projection

``vllm``: the draft model vLLM's ``Medusa`` class loads (``speculative_config={"method":
"medusa", "model": DIR}``) —

    config.json          {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
                          "vocab_size": V, "num_heads": K, "num_hidden_layers": n,
                          "medusa_fc_bias": true, "original_lm_head": shared, "truncated_vocab_size": V, ...}
    model.safetensors    "blocks.{k}.layers.{j}.weight" (H, H), "blocks.{k}.layers.{j}.bias" (H,)
                         "lm_heads.{k}.weight" (V, H) per head, or with "original_lm_head" one
                         "lm_heads.0.weight" that every head shares

Heads that project through the target's shared output layer (speculant's default) get that layer
written out: once for vLLM (``original_lm_head``), once per head for Medusa's code, whose heads
each own a projection. Both engines compute a block as ``x + SiLU(W x + b)``, as speculant does.
Sequential (Hydra) heads have no counterpart in either engine. Every file is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..runtime.weights import weights_of
from .medusa import MedusaHeads

__all__ = ["EXPORT_FORMATS", "export_heads", "write_export_dir"]

EXPORT_FORMATS = ("medusa", "vllm")


def _shared_projection(heads: MedusaHeads) -> torch.Tensor:
    """The target's shared output layer as the (V, H) weights every head projects through (a
    quantized layer's: the weights it stands for)."""
    weights = weights_of(heads.output_layer)
    if weights is None:
        raise ConfigError("the heads' shared output layer has no weights to write out")
    return weights.weight_matrix()


def export_heads(heads, out: str | Path, fmt: str, base_model: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write Medusa ``heads`` to the new directory ``out`` in format ``fmt`` (``EXPORT_FORMATS``);
    ``base_model``: the target's transformers directory (or hub id), recorded for the engine."""
    from safetensors.torch import save_file

    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if not isinstance(heads, MedusaHeads):
        raise ConfigError("only Medusa heads can be exported: sequential (Hydra) heads have no counterpart in "
                          "Medusa's code or vLLM; train Medusa heads with speculant train-heads --head-kind medusa")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: choose a new directory for the export")
    cfg = heads.config
    K, n, H, V = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    blocks = {(k, j): heads.heads[k][j].linear for k in range(K) for j in range(n)}
    shared = _shared_projection(heads) if cfg.shared_lm_head else None  # read (or dequantized) once

    def projection(k: int) -> torch.Tensor:  # head k's vocabulary projection (V, H)
        return shared if shared is not None else heads.heads[k][n].weight.detach()

    def t(x: torch.Tensor) -> torch.Tensor:  # an own copy: safetensors stores no shared tensors
        return x.detach().to(dtype).contiguous().clone()
    if fmt == "medusa":
        tensors = {}
        for (k, j), lin in blocks.items():
            tensors[f"{k}.{j}.linear.weight"], tensors[f"{k}.{j}.linear.bias"] = t(lin.weight), t(lin.bias)
        for k in range(K):
            tensors[f"{k}.{n}.weight"] = t(projection(k))
        config = {"medusa_num_heads": K, "medusa_num_layers": n, "base_model_name_or_path": base_model,
                  "hidden_size": H, "vocab_size": V, "torch_dtype": str(dtype).removeprefix("torch.")}
        weights_name = "medusa_lm_head.safetensors"
    else:
        tensors = {}
        for (k, j), lin in blocks.items():
            tensors[f"blocks.{k}.layers.{j}.weight"] = t(lin.weight)
            tensors[f"blocks.{k}.layers.{j}.bias"] = t(lin.bias)
        for k in range(1 if cfg.shared_lm_head else K):
            tensors[f"lm_heads.{k}.weight"] = t(projection(k))
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H, "vocab_size": V,
                  "num_heads": K, "num_hidden_layers": n, "medusa_fc_bias": True,
                  "original_lm_head": cfg.shared_lm_head,
                  "truncated_vocab_size": V, "max_paths": 64, "topk": 10,
                  "torch_dtype": str(dtype).removeprefix("torch."), "base_model_name_or_path": base_model}
        weights_name = "model.safetensors"
    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / weights_name), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return write_export_dir(out, write)


def write_export_dir(out: Path, write: Callable[[Path], None]) -> Path:
    """Make the export directory ``out`` (absent or empty) whole: ``write`` fills a temporary
    directory beside it, which is then renamed to ``out``, so nobody sees half an export."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            out.rmdir()  # empty (the callers check)
        os.rename(tmp, out)
    except OSError as e:
        raise ConfigError(f"cannot write the export to {out}: {e.strerror or e}; choose a writable directory "
                          "with free space") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
