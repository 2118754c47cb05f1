"""Drafters reading the target's own hidden state through trained heads: Medusa (independent
heads), Hydra (sequential heads) and blockwise parallel decoding (BPD).

Each class owns one tree policy; what they share are components:

    static_tree.py    StaticTreeDrafter: a fixed sparse tree (Medusa's, Hydra's); BlockwiseDrafter: a chain
    dynamic_tree.py   DynamicTree, DynamicTreeDrafter: a tree grown per step from the heads' probabilities,
                      of a fixed size or sized per step against the machine's pass cost (TreeSizer)
    head_eval.py      HeadEvaluator: the heads' first state (hidden state, or a context layer's output)
                      and their ranked candidates; HeadsDrafter: the begin / observe plumbing
    lookup_branch.py  the prompt-lookup chain as one more branch of either kind of tree

:func:`MedusaDrafter` picks the class from its arguments.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..tree import TreeBuffers
from .dynamic_tree import DynamicTree, DynamicTreeDrafter
from .head_eval import HeadsLike
from .lookup import LookupDrafter
from .sizing import TreeSizer
from .static_tree import BlockwiseDrafter, StaticTreeDrafter

__all__ = ["BlockwiseDrafter", "DynamicTree", "DynamicTreeDrafter", "HeadsLike", "MedusaDrafter",
           "StaticTreeDrafter"]


def MedusaDrafter(heads: HeadsLike, tree: TreeBuffers, vocab_size: int, lookup: LookupDrafter | None = None,
                  dynamic: DynamicTree | None = None,
                  sizer: TreeSizer | None = None) -> StaticTreeDrafter | DynamicTreeDrafter:  # noqa: N802
    """The heads' drafter for ``tree`` (:class:`StaticTreeDrafter`) or, with ``dynamic``, for a tree
    grown at every step (:class:`DynamicTreeDrafter`, ``tree`` unused), sized against the pass cost
    with ``sizer``. ``lookup``: the prompt-lookup chain as one more branch."""
    if dynamic is None:
        if sizer is not None:
            raise ConfigError("tree sizing against the pass cost needs a dynamic tree (--tree dynamic...): a static "
                              "tree has a fixed size")
        return StaticTreeDrafter(heads, tree, vocab_size, lookup)
    return DynamicTreeDrafter(heads, dynamic, vocab_size, lookup, sizer)
