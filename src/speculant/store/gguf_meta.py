"""Config fields that transformers' GGUF loader leaves at their defaults, read from the GGUF itself.

transformers maps a Gemma 2 GGUF's shape keys into a Gemma2Config, but not its two soft caps
(``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``) nor the query scale,
which has no key at all: a converted config gets Gemma2Config's defaults (caps 50 and 30,
``query_pre_attn_scalar`` 256). Those are right for the 2B and the 9B only; the 27B scales its
queries by 1/sqrt(hidden_size / num_attention_heads) = 1/sqrt(144). ``config_fixes`` gives the
values llama.cpp runs the same file with: the caps from their keys (a cap the file lacks keeps
the default, which is llama.cpp's default too), and the query scale by llama.cpp's rule, which
goes by model size: n_embd / n_head for the 27B (46 layers), the head dimension otherwise.

Gemma 3 has the same gap: its query scale (the 27B, 62 layers: 5376 / 32 = 168, not 256) and
the linear RoPE scaling of its global layers (``gemma3.rope.scaling.type`` "linear" and
``gemma3.rope.scaling.factor``, 8 for the 4B, 12B and 27B), which transformers does not read:
``rope_parameters`` is set from them, the local (sliding-window) layers keeping base 10,000
unscaled, as llama.cpp runs them.

A conversion records ``VERSION`` in its marker; ``outdated`` names a cache entry of an
architecture fixed here that was converted before (or under an older version): it is redone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

VERSION = 2  # bump whenever the fields set here change: older conversions are redone
FIXED_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")  # config.json model_type of the architectures fixed here
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B of each
_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding-window layers (llama.cpp's and transformers' default)


def meta_value(reader: Any, key: str) -> Any:
    """The value of metadata ``key`` (a per-layer array's first entry), or None if absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    return value[0] if isinstance(value, list) else value


def config_fixes(gguf: str | os.PathLike) -> dict[str, Any]:
    """Config fields to set on the transformers conversion of ``gguf``: {} for an architecture
    whose config transformers reads in full."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = meta_value(reader, "general.architecture")
    if arch not in _27B_LAYERS:
        return {}
    fixes: dict[str, Any] = {}
    if arch == "gemma2":
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = meta_value(reader, f"{arch}.{cap}")
            if value is not None:
                fixes[cap] = float(value)
    hidden = int(meta_value(reader, f"{arch}.embedding_length"))
    heads = int(meta_value(reader, f"{arch}.attention.head_count"))
    head_dim = meta_value(reader, f"{arch}.attention.key_length")
    head_dim = hidden // heads if head_dim is None else int(head_dim)
    layers = int(meta_value(reader, f"{arch}.block_count"))
    fixes["query_pre_attn_scalar"] = hidden // heads if layers == _27B_LAYERS[arch] else head_dim
    if arch == "gemma3":
        kind = meta_value(reader, f"{arch}.rope.scaling.type")
        factor = meta_value(reader, f"{arch}.rope.scaling.factor")
        if kind == "linear" and factor is not None and float(factor) != 1.0:
            base = meta_value(reader, f"{arch}.rope.freq_base")
            fixes["rope_parameters"] = {
                "full_attention": {"rope_type": "linear", "factor": float(factor),
                                   "rope_theta": 1e6 if base is None else float(base)},
                "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE}}
    return fixes


def apply(config: Any, gguf: str | os.PathLike) -> dict[str, Any]:
    """Set ``config_fixes(gguf)`` on the transformers ``config``; returns the fields set."""
    fixes = config_fixes(gguf)
    for name, value in fixes.items():
        setattr(config, name, value)
    return fixes


def outdated(marker: Path) -> str | None:
    """Why the complete cache entry whose marker file is ``marker`` must be converted again (an
    architecture fixed here, converted before ``VERSION``), or None."""
    try:
        model_type = json.loads((marker.parent / "config.json").read_text()).get("model_type")
        if model_type not in FIXED_MODEL_TYPES:
            return None
        version = json.loads(marker.read_text()).get("config_fixes", 0)
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: not this module's to judge (loading names the problem)
    if isinstance(version, int) and version >= VERSION:
        return None
    return (f"was converted before speculant set the {model_type} config fields transformers does "
            "not read from a GGUF (soft caps, query scale, RoPE scaling)")
