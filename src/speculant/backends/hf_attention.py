"""Grouped-query attention for tree verification on the transformers backend.

transformers' ``sdpa`` attention copies every key/value head ``num_key_value_groups`` times
(``repeat_kv``) whenever a pass of several queries carries a mask, which every tree verification
does: for Qwen2.5-1.5B (12 query heads on 2 KV heads) that is a 6x copy of the whole KV cache in
every layer of every step, ~15 ms a step at 1,200 tokens of context on 2 cores. This function is
registered under transformers' own extension point (``AttentionInterface``) and hands such passes
to ``scaled_dot_product_attention(..., enable_gqa=True)``, which reads the KV heads in place. Every
other pass (prefill without a mask, one-token decoding, models without grouped heads) goes to
transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "speculant_sdpa"


def tree_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query (B, Hq, n, d); key, value (B, Hkv, L, d); attention_mask (B, 1, n, L) additive or bool.

    Returns (B, n, Hq, d) and no attention weights, like transformers' attention functions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (attention_mask is None or query.shape[2] == 1 or groups == 1
             or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
             or attention_mask.dim() != 4 or attention_mask.shape[1] != 1)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # (B, Hq, n, d)
    return out.transpose(1, 2).contiguous(), None


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model that uses ``sdpa`` to :func:`tree_sdpa_attention` (same results;
    models on any other attention implementation are left as they are)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(NAME, tree_sdpa_attention)
    # the masks transformers builds for it (e.g. left padding in batched generate) stay sdpa's
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
