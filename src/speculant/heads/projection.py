"""The target's frozen output layer as the heads use it: projecting head states to logits, checking
a layer against a :class:`~speculant.heads.config.HeadsConfig`, and ranking candidates through a
low-bit copy of its rows (a shortlist re-ranked exactly). H = hidden size, V = vocabulary size,
V' = the rows drafted from (a draft vocabulary, or the first ``limit`` rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..runtime.weights import weights_of
from .config import HeadsConfig

__all__ = ["COARSE_EXTRA", "DraftVocabulary", "check_lm_head", "coarse_ranker", "frozen_projection", "layer_dtype",
           "layer_shape", "shortlist_topk"]


COARSE_EXTRA = 8  # shortlist k + this many tokens with the int4 copy, then rank them exactly


def shortlist_topk(coarse: nn.Module, rows: torch.Tensor, states: torch.Tensor, k: int):
    """The top k of ``states @ rows.T`` through the int4 copy ``coarse`` of ``rows`` (V', H): its
    top k + COARSE_EXTRA, ranked with the exact rows. states (n, H) -> (indices into rows (n, k),
    their exact logits (n, k) float, the int4 logits (n, V') float)."""
    rough = coarse(states.to(torch.bfloat16)).float()
    short = rough.topk(k + COARSE_EXTRA, dim=-1).indices  # (n, k + COARSE_EXTRA)
    # the shortlisted rows' exact logits, in float32 element by element: a bf16 batched matmul of
    # these shapes goes through oneDNN and costs about twice as much
    exact = (rows[short].float() * states.float()[:, None, :]).sum(-1)
    top = exact.topk(k, dim=-1, sorted=True)
    return short.gather(-1, top.indices), top.values, rough


def coarse_ranker(rows: torch.Tensor | None):
    """A low-bit copy of output-layer rows (V', H) (a draft vocabulary's, or a whole shared
    layer's for Medusa heads), or None for shapes it does not take: int4 in groups of 64 inputs
    (speculant's int4 kernel where it runs, else PyTorch's own int4 matmul), int8 with one scale per
    row where int4 does not apply. The shortlist it gives is re-ranked with the exact rows, so the
    proposals change only where the true top-k falls outside the low-bit top-(k + COARSE_EXTRA),
    and the target verifies every token anyway."""
    # Why a low-bit shortlist: docs/design-notes.md#low-bit-shortlist-for-head-drafting
    from ..kernels import GROUP
    from ..runtime.quant import Int4Linear, Int8Linear

    if rows is None or rows.shape[0] < 1024:
        return None
    n = rows.shape[0]
    if rows.shape[1] % GROUP == 0:  # int4 packs 16 output rows together: pad with zero rows, cut them off after
        padded = torch.cat([rows.to(torch.bfloat16), rows.new_zeros((-n) % 16, rows.shape[1], dtype=torch.bfloat16)])
        layer = nn.Linear(rows.shape[1], padded.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(padded, requires_grad=False)
        try:
            int4 = Int4Linear(layer, keep_dense=False)
            return int4 if padded.shape[0] == n else _FirstOutputs(int4, n)
        except Exception:  # noqa: BLE001 -- neither int4 path runs here (no kernel, no PyTorch int4 op): try int8
            pass
    layer = nn.Linear(rows.shape[1], n, bias=False, device="meta")
    layer.weight = nn.Parameter(rows.to(torch.bfloat16), requires_grad=False)
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    return Int8Linear(layer, keep_dense=False)



class _FirstOutputs(nn.Module):
    """A layer's first ``n`` outputs (the rest: padding rows of its weight)."""

    def __init__(self, layer: nn.Module, n: int):
        super().__init__()
        self.layer, self.n = layer, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[..., :self.n]


def frozen_projection(layer: nn.Module, x: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The target's output layer on x (..., H) -> (..., V), or (..., V') for the rows ``vocab``
    (V',); gradients reach x, never the layer. A quantized output layer without a dense weight
    (the native backend's ``--quant-head``) is called as it is (inference only)."""
    weights = weights_of(layer)
    weight = weights.dense_weight()
    if weight is None:
        if vocab is not None:
            raise ValueError("vocab= needs a dense output layer (training runs on the transformers model)")
        return layer(x.to(weights.dtype))
    bias = weights.bias.detach() if weights.bias is not None else None
    if vocab is not None:
        weight, bias = weight[vocab], (bias[vocab] if bias is not None else None)
    return F.linear(x.to(weight.dtype), weight, bias)


def layer_shape(layer: nn.Module | None) -> tuple[int, int] | None:
    """(V, H) of an output layer (``runtime.weights``: a dense layer's weight, a quantized one's
    (out, in) features), or None for a module that is no linear layer."""
    weights = weights_of(layer)
    return tuple(weights.weight_shape) if weights is not None else None


def layer_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype an output layer computes in: a dense layer's weight's, a quantized one's activations'."""
    return weights_of(layer).dtype


def check_lm_head(lm_head: nn.Module, config: HeadsConfig) -> None:
    shape = layer_shape(lm_head)
    if shape is None:
        raise ConfigError("lm_head must be the target's output layer (a module with a (V, H) weight)")
    V, H = shape
    if H != config.hidden_size:
        raise ModelLoadError(
            f"the heads read hidden states of size {config.hidden_size} but the target's hidden size is {H}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")
    if V != config.vocab_size:
        raise ModelLoadError(
            f"the heads predict a vocabulary of {config.vocab_size} tokens but the target's output layer has {V}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")


class DraftVocabulary:
    """Drafting through the target's frozen output layer, for heads that propose from a state
    (``SequentialHeads``, the EAGLE drafter): ``project`` a state to logits, and ``draft_topk``
    over an optional draft vocabulary (``config.draft_vocab`` = V' > 0 ids stored in the buffer
    ``draft_vocab``), through a low-bit shortlist of its rows where one applies
    (``coarse_ranking``). The class using it sets ``config`` (``vocab_size``, ``draft_vocab``),
    ``draft_vocab`` (buffer or None) and ``coarse_ranking``, and hands it the target's layers
    with :meth:`_share_target` (read back as :attr:`output_layer` and :attr:`input_embeddings`)."""

    def _share_target(self, lm_head: nn.Module, embed: nn.Module) -> None:
        """Hold the target's frozen output layer (V, H) and input embeddings (V, H): in a tuple, so
        they are no parameters, never saved, untouched by ``.to()``."""
        self._shared: tuple[nn.Module, nn.Module] = (lm_head, embed)
        self._draft_rows: tuple | None = None  # (key, draft vocabulary < limit, its output-layer rows, int4 copy)

    @property
    def output_layer(self) -> nn.Module:
        """The target's frozen output layer, H -> V (dense or quantized: ``runtime.weights``)."""
        return self._shared[0]

    @property
    def input_embeddings(self) -> nn.Module:
        """The target's frozen input embeddings (an ``nn.Embedding``, (V, H))."""
        return self._shared[1]

    def project(self, state: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """state (..., H) -> logits (..., V) through the target's frozen output layer (only the
        columns ``vocab`` (V',), when given)."""
        return frozen_projection(self.output_layer, state, vocab)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Store the draft vocabulary: ``config.draft_vocab`` distinct token ids < V."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        V = self.config.vocab_size
        if self.draft_vocab is None or ids.numel() != self.draft_vocab.numel() or ids.unique().numel() != ids.numel() \
                or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ConfigError(f"the draft vocabulary must be {self.config.draft_vocab} distinct token ids in [0, {V})")
        self.draft_vocab.copy_(ids.sort().values)
        self._draft_rows = None

    @torch.no_grad()
    def draft_topk(self, state: torch.Tensor, k: int, limit: int | None = None,
                   logprobs: bool = False):
        """state (n, H) -> (n, k) long: the k best-ranked tokens (< ``limit``) of each state's
        logits, over the draft vocabulary when there is one. Ties: ``topk`` order. ``logprobs``:
        also return their log-probabilities (n, k) under the softmax over those tokens."""
        if self.draft_vocab is None:
            logits = self.project(state)[..., :limit].float()
            top = logits.topk(k, dim=-1, sorted=True)
            if logprobs:
                return top.indices, top.values - logits.logsumexp(-1, keepdim=True)
            return top.indices
        layer = self.output_layer
        weights = weights_of(layer)
        weight = weights.dense_weight()
        # the draft vocabulary cut to `limit` and its rows of the output layer (dense, or dequantized
        # once, not all V per call): a cached copy, since slicing V' rows per call would cost as much
        # as the product itself
        key = (limit, self.draft_vocab.data_ptr(), id(layer) if weight is None else (weight.data_ptr(), weight.dtype),
               self.coarse_ranking)
        if self._draft_rows is None or self._draft_rows[0] != key:
            vocab = self.draft_vocab if limit is None else self.draft_vocab[self.draft_vocab < limit]
            rows = weights.weight_rows(vocab).contiguous()
            self._draft_rows = (key, vocab, rows, coarse_ranker(rows) if self.coarse_ranking else None)
        _, vocab, rows, coarse = self._draft_rows
        if coarse is not None and k + COARSE_EXTRA < rows.shape[0]:
            idx, values, rough = shortlist_topk(coarse, rows, state, k)
            if logprobs:  # normalised by the int4 logits' log-sum-exp
                return vocab[idx], values - rough.logsumexp(-1, keepdim=True)
            return vocab[idx]
        logits = F.linear(state.to(rows.dtype), rows).float()
        top = logits.topk(k, dim=-1, sorted=True)
        if logprobs:
            return vocab[top.indices], top.values - logits.logsumexp(-1, keepdim=True)
        return vocab[top.indices]

    def mask_to_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) with every token outside the draft vocabulary at -inf (as drafting sees them)."""
        if self.draft_vocab is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[self.draft_vocab[self.draft_vocab < logits.shape[-1]]] = True
        return logits.masked_fill(~keep, float("-inf"))
