"""Rotary position embeddings for the native runtime: the inverse frequencies and the attention
scaling of a checkpoint's RoPE, plain or scaled (Llama 3's ``llama3``, ``linear``, ``yarn``,
``dynamic``, ``longrope``), as transformers computes them (its ``ROPE_INIT_FUNCTIONS``: the same
numbers the reference implementation uses, so greedy text matches it).

Frequencies that depend on the sequence's length (``dynamic`` NTK, ``longrope``'s long factors) are
fixed here at those of the original context: a rotation never changes once a key is cached, which
exact speculation needs (a verified token must get the bits a one-token pass gives). The context
is then limited to the original one (:attr:`Rope.max_context`), where both schemes equal plain
RoPE (``dynamic``) or its short factors (``longrope``).

Shapes: D the head dimension, R <= D the rotated dimensions (``partial_rotary_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

__all__ = ["Rope", "rope_for"]

LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class Rope:
    """``inv_freq`` (R/2,) float32; ``scale``: the factor on cos and sin (yarn's attention
    factor, 1.0 otherwise); ``max_context``: positions beyond it are refused (0: no limit)."""

    inv_freq: torch.Tensor
    scale: float = 1.0
    max_context: int = 0
    kind: str = "default"


def _params(cfg, layer_type: str | None) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = getattr(cfg, "rope_scaling", None) or {}
    return {**scaling, **params}


def rope_for(cfg, head_dim: int, layer_type: str | None = None) -> Rope:
    """The RoPE of transformers config ``cfg`` (for the layers of ``layer_type`` where the config
    gives each kind of layer its own, as Gemma 3's sliding and full attention do)."""
    params = _params(cfg, layer_type)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind in ("su", "longrope"):
        kind = "longrope"
    if kind == "default":
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
        if theta is None:
            raise ConfigError("the model config has no rope_theta")
        rotated = int(head_dim * float(params.get("partial_rotary_factor",
                                                   getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)))
        inv = 1.0 / float(theta) ** (torch.arange(0, rotated, 2, dtype=torch.int64).float() / rotated)
        return Rope(inv, 1.0, 0, kind)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(kind)
    if init is None:
        raise ConfigError(f"the native backend does not know the RoPE scaling {kind!r} (it knows default, "
                          f"{', '.join(ROPE_INIT_FUNCTIONS)}): use backend='hf'")
    try:
        inv, scale = (init(cfg, torch.device("cpu"), layer_type=layer_type) if layer_type
                      else init(cfg, torch.device("cpu")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"cannot read the model's {kind} RoPE parameters ({type(e).__name__}: {e})") from None
    limit = 0
    if kind in LENGTH_DEPENDENT:
        limit = int(params.get("original_max_position_embeddings")
                    or getattr(cfg, "original_max_position_embeddings", 0)
                    or getattr(cfg, "max_position_embeddings", 0))
    return Rope(inv.float(), float(scale), limit, kind)
