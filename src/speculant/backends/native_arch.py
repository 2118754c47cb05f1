"""What a model family changes in the native runtime's decoder layer, read from its transformers
config once: :class:`Arch` (norms, embedding scale, MLP activation, sandwich norms, attention scale
and soft-capping) and each layer's RoPE and attention window (:func:`layer_plan`).

Families (``SUPPORTED``): Llama (2 and 3.x: RoPE scaling, tied embeddings), Mistral, Qwen2,
Qwen3 (per-head q/k RMSNorm), Phi-3 (fused q/k/v and gate/up weights, split when read), and the
Gemma text models, Gemma 2 (``gemma2``) and Gemma 3 (``gemma3_text``): (1 + w) RMSNorm, embeddings
scaled by sqrt(H), GELU-tanh MLP, norms after attention and after the MLP as well as before, an
attention scale of query_pre_attn_scalar^-1/2, sliding-window layers interleaved with global ones
(a query at position p sees the keys at positions > p - window, as transformers' masks do).
Gemma 3 adds q/k norms (its query scale folded into the query norm) and a RoPE base per kind of
layer; Gemma 2 soft-caps the attention scores and the output logits (cap * tanh(x / cap)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from .rope import Rope, rope_for

__all__ = ["Arch", "SUPPORTED", "arch_for", "attention_windows", "layer_plan", "native_refusal"]

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class Arch:
    """``norm_offset``: RMSNorm scales by (offset + w) (Gemma's 1; folded into the weights when
    they are read); ``embed_scale``: the embeddings' factor; ``act``: "silu" or "gelu_tanh";
    ``sandwich``: the attention and the MLP outputs are normed too before their residual adds;
    ``q_scale``: the attention's scale relative to 1/sqrt(D) (Gemma's query_pre_attn_scalar),
    folded into the query norm (Gemma 3); ``attn_scale``: the attention's scale itself where no
    query norm takes it (Gemma 2), None for 1/sqrt(D); ``attn_softcap`` / ``final_softcap``: the
    attention scores (before the mask) / the output logits become cap * tanh(x / cap) (0: not)."""

    family: str
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    act: str = "silu"
    sandwich: bool = False
    q_scale: float = 1.0
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    @property
    def plain_attention(self) -> bool:
        """softmax(q k / sqrt(D)) under the mask: what SDPA and speculant's attention kernels compute."""
        return self.attn_scale is None and not self.attn_softcap


def arch_for(cfg) -> Arch:
    """The :class:`Arch` of transformers config ``cfg``, or a ConfigError for a family (or a
    feature) the native backend does not run."""
    kind = cfg.model_type
    if kind not in SUPPORTED:
        raise ConfigError(f"the native backend runs {', '.join(SUPPORTED)} models, not {kind!r}: use backend='hf'")
    if kind in GEMMA:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"the native backend runs Gemma's GELU-tanh MLP, not {act!r}: use backend='hf'")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ConfigError("the native backend runs causal attention only: use backend='hf'")
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        scalar = float(getattr(cfg, "query_pre_attn_scalar", None) or D)
        common = dict(norm_offset=1.0, embed_scale=math.sqrt(cfg.hidden_size), act="gelu_tanh", sandwich=True,
                      attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
                      final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0))
        if kind == "gemma2":  # no q/k norms: the attention applies the scale, as transformers computes it
            return Arch(kind, attn_scale=scalar ** -0.5, **common)
        return Arch(kind, q_scale=math.sqrt(D / scalar), **common)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"the native backend needs a SiLU MLP, not {act!r}: use backend='hf'")
    return Arch(kind)


def _layer_types(cfg) -> list[str]:
    """Each layer's kind, "full_attention" or "sliding_attention", as transformers reads ``cfg``."""
    layers = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or [])
    if types and len(types) != layers:
        raise ConfigError(f"the config lists {len(types)} layer types for {layers} layers")
    if not types:
        types = ["full_attention"] * layers
        if _uses_window(cfg):
            first = getattr(cfg, "max_window_layers", 0) if cfg.model_type in ("qwen2", "qwen3") else 0
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return types


def _uses_window(cfg) -> bool:
    window = int(getattr(cfg, "sliding_window", None) or 0)
    return bool(window) and bool(getattr(cfg, "use_sliding_window", cfg.model_type in ("mistral", "phi3", *GEMMA)))


def attention_windows(cfg) -> list[int]:
    """Each layer's sliding attention window (0: full attention): a query at position p sees the
    keys at positions > p - window."""
    window = int(getattr(cfg, "sliding_window", None) or 0) if _uses_window(cfg) else 0
    return [window if t == "sliding_attention" else 0 for t in _layer_types(cfg)]


def layer_plan(cfg, head_dim: int) -> tuple[list[Rope], list[int], list[int]]:
    """(the distinct RoPEs, each layer's index among them, each layer's sliding window (0: full
    attention)) of ``cfg``'s layers."""
    types = _layer_types(cfg)
    per_type = isinstance((getattr(cfg, "rope_parameters", None) or {}).get("full_attention"), dict)
    ropes: list[Rope] = []
    keys: list[str] = []
    layer_rope = []
    for t in types:
        key = t if per_type else "all"
        if key not in keys:
            keys.append(key)
            ropes.append(rope_for(cfg, head_dim, t if per_type else None))
        layer_rope.append(keys.index(key))
    windows = attention_windows(cfg)
    for rope in ropes:
        if 2 * rope.inv_freq.numel() != head_dim:
            raise ConfigError(f"the native backend rotates whole heads; this model rotates "
                              f"{2 * rope.inv_freq.numel()} of {head_dim} dimensions: use backend='hf'")
    return ropes, layer_rope, windows


def native_refusal(config: dict) -> str | None:
    """Why the native backend does not run the model of ``config`` (a config.json's fields), or
    None when it does: the checks loading makes (the architecture, and each layer's RoPE and
    window: :func:`layer_plan`), before any weight is read."""
    from types import SimpleNamespace

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        arch_for(SimpleNamespace(**text))
        cfg = _config_object(text)
        if cfg is not None:
            heads = int(cfg.num_attention_heads)
            layer_plan(cfg, getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    except ConfigError as e:
        return str(e).split(": use backend=")[0]
    return None


def _config_object(fields: dict):
    """transformers' config class of ``fields["model_type"]`` filled with ``fields`` (its defaults
    and derived fields, e.g. the layer types), or None for a type it does not know."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**fields)
    except (KeyError, ValueError, TypeError):
        return None
