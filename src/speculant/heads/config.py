"""The shape of a set of heads (:class:`HeadsConfig`), as saved in a checkpoint's ``config.json``.

Notation as in :mod:`speculant.heads`: H = hidden size, V = vocabulary size, K = number of heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["HEAD_KINDS", "HeadsConfig"]

HEAD_KINDS = ("medusa", "sequential")


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of heads. ``base_model``: the target they were trained for (informative)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = True
    base_model: str = ""
    kind: str = "medusa"  # "medusa" (MedusaHeads) or "sequential" (SequentialHeads)
    draft_vocab: int = 0  # sequential: propose only these many tokens (a stored id list), 0 = all
    context_size: int = 0  # sequential: a prefix-attention layer with this MLP width (ContextLayer), 0 = none

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.kind == "sequential" and not self.shared_lm_head:
            raise ConfigError("sequential heads project through the target's output layer: use shared_lm_head=True")
        if not isinstance(self.draft_vocab, int) or not 0 <= self.draft_vocab <= self.vocab_size:
            raise ConfigError(f"draft_vocab must be an integer in [0, {self.vocab_size}], got {self.draft_vocab!r}")
        if self.draft_vocab and self.kind != "sequential":
            raise ConfigError("a draft vocabulary is an option of sequential heads")
        if not isinstance(self.context_size, int) or self.context_size < 0:
            raise ConfigError(f"context_size must be an integer >= 0, got {self.context_size!r}")
        if self.context_size and self.kind != "sequential":
            raise ConfigError("a context (prefix-attention) layer is an option of sequential heads")
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"heads {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ConfigError(f"heads num_layers must be an integer >= 0, got {self.num_layers!r}")

    def to_json(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "base_model_name_or_path": self.base_model, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "speculant_shared_lm_head": self.shared_lm_head,
                "speculant_head_kind": self.kind, "speculant_draft_vocab": self.draft_vocab,
                "speculant_context_size": self.context_size}
