"""Drafters reading the target's own hidden state: Medusa (independent heads), Hydra (sequential
heads), EAGLE and blockwise parallel decoding (BPD).

Each drafter class owns one tree policy and is composed with what proposes the nodes:

    proposers.py      TreeProposer, the protocol of what proposes a tree's children; Stepwise (beam
                      growth over a StepSource); proposer_for(heads, V)
    head_steps.py     IndependentHeads (Medusa), SequentialSteps (Hydra; its context layer) and
                      their jobs; eagle/drafter.py's EagleSteps is the EAGLE drafter's StepSource
    static_tree.py    StaticTreeDrafter: a fixed sparse tree (Medusa's, Hydra's); BlockwiseDrafter: a chain
    dynamic_tree.py   DynamicTree, DynamicTreeDrafter: a tree grown per step from the proposer's
                      probabilities, of a fixed size or sized per step against the machine's pass cost
    lookup_branch.py  the prompt-lookup chain as one more branch of either kind of tree

:func:`MedusaDrafter` picks the class from its arguments.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..trees.buffers import TreeBuffers
from .dynamic_tree import DynamicTree, DynamicTreeDrafter
from .head_steps import HeadsLike
from .lookup import LookupDrafter
from .proposers import proposer_for
from ..tuning.sizing import TreeSizer
from .static_tree import BlockwiseDrafter, StaticTreeDrafter

__all__ = ["BlockwiseDrafter", "DynamicTree", "DynamicTreeDrafter", "HeadsLike", "MedusaDrafter",
           "StaticTreeDrafter"]


def MedusaDrafter(heads: HeadsLike, tree: TreeBuffers, vocab_size: int, lookup: LookupDrafter | None = None,
                  dynamic: DynamicTree | None = None,
                  sizer: TreeSizer | None = None) -> StaticTreeDrafter | DynamicTreeDrafter:
    """The drafter of ``heads`` (any the proposers take: Medusa heads, sequential heads, an EAGLE
    drafter; ``proposers.proposer_for``) for ``tree`` (:class:`StaticTreeDrafter`) or, with ``dynamic``, for a tree
    grown at every step (:class:`DynamicTreeDrafter`, ``tree`` unused), sized against the pass cost
    with ``sizer``. ``lookup``: the prompt-lookup chain as one more branch."""
    if dynamic is None:
        if sizer is not None:
            raise ConfigError("tree sizing against the pass cost needs a dynamic tree (--tree dynamic...): a static "
                              "tree has a fixed size")
        return StaticTreeDrafter(proposer_for(heads, vocab_size), tree, vocab_size, lookup)
    return DynamicTreeDrafter(proposer_for(heads, vocab_size), dynamic, vocab_size, lookup, sizer)
