"""Linear layers with their bf16 weights blocked once instead of at every call.

``nn.functional.linear`` on a bf16 CPU tensor hands oneDNN a plain (N, K) weight, which it
reorders into its blocked layout at every call. A decoding step is bound by reading the weights,
so the reorder is a second full pass over them. :class:`PackedLinear` blocks the weight once:
in speculant's own layout where its kernels build (``kernels/bf16_amx.cpp``: each weight tile
multiplies up to 32 rows per pass over the weights; ``kernels/bf16_avx512.cpp`` on AVX-512 BF16
without AMX, same layout), else in oneDNN's (what ``torch.compile``'s
freezing pass does for CPU, called through ``mkldnn._linear_pointwise``).
What each layout costs by rows: docs/design-notes.md#packed-bf16-weights

Packing changes no result beyond the order of fp32 additions (the tests check logits against the
plain model's), and every method, ``ar`` included, gets the speed-up.

A packed layer keeps no (N, K) weight; :func:`unpack_linears` restores ``nn.Linear`` layers
exactly (speculant's layout is a permutation; oneDNN's is read back as ``I @ W.T``) for code that
needs them (LoRA training, quantization, the native backend). The output layer keeps its plain
weight too (``keep_weight``), since heads project through it; with tied embeddings that weight is
the embedding matrix and costs nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_kernels, pack_bf16
from .weights import LinearWeights

# the batch size oneDNN picks its blocked layout for (a tree pass): docs/design-notes.md#packed-bf16-weights
ROWS_HINT = 32
_EMPTY = torch.empty(0, dtype=torch.bfloat16)


def available() -> bool:
    """True where this torch build has oneDNN's prepacked bf16 linear (x86 CPUs with AVX-512 bf16 / AMX)."""
    ops = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(LinearWeights, nn.Module):
    """``y = x @ W.T + b`` with W held in a blocked layout (bf16, CPU, inference only).

    Two layouts: speculant's own (``kernels/bf16_amx.cpp`` / ``bf16_avx512.cpp``) where its
    kernels run and the shape suits it (both sizes multiples of 32), else
    oneDNN's (``mkldnn._reorder_linear_weight``). Its weight is read through the
    :class:`~speculant.runtime.weights.LinearWeights` protocol (the kept plain weight, else the
    blocked one read back).
    """

    dtype = torch.bfloat16

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        kernels = cpu_kernels()
        self.own = kernels is not None and self.in_features % 32 == 0 and self.out_features % 32 == 0
        # the blocked copy; a buffer (not a parameter): it is not trained and not saved with the model
        packed = pack_bf16(w) if self.own else torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias
        # (N, K) plain weight, kept for readers of it (heads projecting through the output layer)
        self.weight = linear.weight if keep_weight else None
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        bias = self.bias.detach() if self.bias is not None else _EMPTY
        y = self._kernels.bf16_mm(x.reshape(-1, shape[-1]).contiguous(), self.packed, bias)
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight, read back from the blocked layout where no plain copy is kept."""
        return self.unpacked().weight.detach()

    def unpacked(self) -> nn.Linear:
        """The ``nn.Linear`` this layer computes (the kept weight, or the packed one read back exactly)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta", dtype=torch.bfloat16)
        if self.weight is not None:
            linear.weight = self.weight
        else:
            with torch.no_grad():
                if self.own:  # pack_bf16's permutation undone
                    w = self.packed.permute(0, 3, 1, 2, 4).reshape(self.out_features, self.in_features).contiguous()
                else:
                    eye = torch.eye(self.in_features, dtype=torch.bfloat16)
                    # row i of I @ W.T is column i of W.T: one nonzero product per output, so exact
                    w = torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t().contiguous()
            linear.weight = nn.Parameter(w, requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={'speculant' if self.own else 'onednn'}")


def swap_modules(model: nn.Module, kind: type, make, want=lambda mod: True) -> int:
    """Replace every module of exactly type ``kind`` for which ``want`` holds by ``make(module)``."""
    found = [(name, mod) for name, mod in model.named_modules() if type(mod) is kind and want(mod)]
    for name, mod in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, make(mod))
    return len(found)


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 ``nn.Linear`` of ``model`` on the CPU by a :class:`PackedLinear`, in place.

    Does nothing (returns 0) where oneDNN's bf16 linear is missing, for a float32 model, or for
    layers already packed; returns how many layers it packed. The output layer keeps its weight.
    """
    if not available():
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        return swap_modules(model, nn.Linear, lambda linear: PackedLinear(linear, keep_weight=linear is head),
                     want=lambda linear: linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu")


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears` in place (``nn.Linear`` layers with the same weights); returns the count."""
    return swap_modules(model, PackedLinear, PackedLinear.unpacked)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
