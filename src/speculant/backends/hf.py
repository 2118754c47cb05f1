"""Any transformers causal LM as a Backend: 4D tree mask + explicit position ids + our KV cache."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..runtime.kv_cache import KVCache
from ..runtime.packing import pack_linears
from .base import CacheBacked, ForwardOut, HiddenNeed, check_layers
from .hf_attention import use_tree_attention
from .native_arch import attention_windows


class HFBackend(CacheBacked):
    """Wraps a transformers ``*ForCausalLM`` (eval mode, batch size 1).

    The decoder stack produces the final normed hidden state; the output layer is applied only to
    the rows whose logits are needed (a prompt's prefill needs one row, not T × V). A model on
    ``sdpa`` attention is switched to :mod:`.hf_attention`'s grouped-query form of it (same
    results, no copy of the KV heads in a tree pass). ``pack``: a bf16 model's linear layers are
    swapped for :class:`~speculant.runtime.packing.PackedLinear` (same results, faster on CPU; in place —
    :func:`~speculant.runtime.packing.unpack_linears` undoes it).
    """

    def __init__(self, model: torch.nn.Module, name: str = "hf", pack: bool = True):
        self.model = model.eval()
        use_tree_attention(model)  # sdpa without repeat_kv for masked passes (hf_attention.py)
        if pack:
            pack_linears(model)  # bf16 weights blocked for AMX once, not at every call (packing.py)
        self.name = name
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.vocab_size = self.head.out_features
        self.dtype = next(model.parameters()).dtype
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        text = model.config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.cache = KVCache(self.num_layers)
        # sliding-window layers: the masks speculant passes must leave out the keys past the window
        # too; a model with both kinds of layer takes one mask per kind (transformers' mapping)
        try:
            windows = set(attention_windows(text)) - {0}
        except (ConfigError, AttributeError, TypeError):
            windows = set()
        if len(windows) > 1:
            raise ConfigError(f"sliding windows of {sorted(windows)} tokens in one model are not supported")
        self.window = windows.pop() if windows else 0
        self.per_kind = bool(self.window) and bool(getattr(text, "layer_types", None))

    @torch.no_grad()
    def forward(self, tokens, positions=None, tree_mask=None, rows=None,
                want_hidden: HiddenNeed = HiddenNeed.NONE, layers=()) -> ForwardOut:
        n = tokens.shape[0]
        layers = check_layers(layers, self.num_layers) if want_hidden is not HiddenNeed.NONE else ()
        past = self.cache.length
        if positions is None:
            positions = torch.arange(past, past + n)
        mask = None
        if tree_mask is not None or past > 0:
            if tree_mask is None:
                tree_mask = torch.ones(n, n, dtype=torch.bool).tril_()
            free = past + n - tree_mask.shape[1]  # cached entries every new token may see
            allowed = torch.cat([torch.ones(n, free, dtype=torch.bool), tree_mask], dim=1)  # (n, past+n)
            mask = self._additive(allowed)
            if self.window:  # the committed keys at positions 0 .. past-1, the new ones at ``positions``
                keys = torch.cat([torch.arange(past), positions])
                windowed = self._additive(allowed & (keys[None, :] > positions[:, None] - self.window))
                mask = {"full_attention": mask, "sliding_attention": windowed} if self.per_kind else windowed
        out = self.decoder(
            input_ids=tokens.view(1, n),
            position_ids=positions.view(1, n),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        h = full = out.last_hidden_state[0]  # (n, H)
        if layers:  # hidden_states[i]: the residual stream entering layer i
            full = torch.cat([full] + [out.hidden_states[i][0].to(full.dtype) for i in layers], -1)
        if rows is not None:
            h = h.index_select(0, rows)
        logits = self.head(h).float()  # (m, V)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if layers and want_hidden is HiddenNeed.LAST:
            h = full if rows is None else full.index_select(0, rows)
        return ForwardOut(logits, {HiddenNeed.NONE: None, HiddenNeed.LAST: h, HiddenNeed.ALL: full}[want_hidden])

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(1, 1, n, T) additive mask of ``allowed`` (n, T) bool."""
        mask = torch.zeros(1, 1, *allowed.shape, dtype=self.dtype)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def reset(self) -> None:
        self.cache = KVCache(self.num_layers)

    def sibling(self) -> "HFBackend":
        """A backend for another sequence over the same model (its own, empty KV cache). The
        transformers backend has no fused multi-sequence pass: ``forward_batch`` runs its
        sequences one after another."""
        other = object.__new__(HFBackend)
        other.__dict__.update(self.__dict__)
        other.cache = KVCache(self.num_layers)
        return other
