"""Building a decoder's drafter from its (resolved) ``DecoderConfig``.

A decoder prepares once what its drafters share (:class:`DraftParts`: the verified tree, a dynamic
tree's settings, the tree sizer, the draft model's backend, the heads) and builds a fresh drafter
for every generation with :func:`build_drafter`, since a drafter keeps per-sequence state.

method   drafter
ar       NoDrafter (plain decoding)
lookup   LookupDrafter, a chain of up to gamma tokens (sized per step with a sizer)
medusa   MedusaDrafter over the heads: a static tree, or a dynamic one grown per step; hydra
hydra    likewise with sequential heads; both optionally with a prompt-lookup branch
eagle    EagleDrafter, the EAGLE drafter's dynamic tree (optionally with the lookup branch)
bpd      BlockwiseDrafter, the heads' top-1 tokens as a chain of gamma
sd/mcsd  DraftModelDrafter, a draft model's chain (gamma) or k-config tree

A generation with a ``prediction`` (the token ids of the text its output is expected to be:
OpenAI's Predicted Outputs) searches it with prompt lookup (``LookupDrafter``): the lookup
method's chain, the lookup branch of medusa, hydra and eagle (one of PREDICTION_GAMMA tokens added
where the decoder has none), and for ar, bpd, sd and mcsd a lookup chain of PREDICTION_GAMMA in
place of their drafter for that generation. The target verifies every token: the output is the
same with or without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..backends.base import Backend
from ..config import (DEFAULT_EAGLE_TREE, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS, DEFAULT_MEDUSA_TREE, DEFAULT_TREE_ROWS, NEEDS_HEADS,
                      TREE_METHODS, DecoderConfig, SamplingConfig)
from ..tuning.costmodel import PassCost, machine_key, pass_cost
from ..heads import heads_tree
from ..trees.buffers import TreeBuffers, build_tree, chain
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .lookup import LookupDrafter
from .medusa import BlockwiseDrafter, DynamicTree, MedusaDrafter
from .proposers import proposer_for
from ..tuning.sizing import TreeSizer

__all__ = ["DraftParts", "build_drafter", "build_sizer", "target_pass_cost", "plan_tree", "warm_up_heads"]

MIN_DYNAMIC_NODES = 4  # the heads' share of a default dynamic tree never drops below this
PREDICTION_GAMMA = 8  # the lookup chain a prediction drafts where the decoder has no lookup of its own


@dataclass(frozen=True)
class DraftParts:
    """What every drafter of one decoder shares.

    tree: the verified tree of a static-tree method (a chain of gamma for chain methods; for a
    dynamic tree, the heads' shipped tree, used only for checks). dynamic: a dynamic tree's
    settings, or None. sizer: sizes each step's tree against the pass cost, or None. draft: the
    draft model's backend (sd, mcsd). heads: the drafting heads (medusa, hydra, bpd). vocab_size:
    the vocabulary target and draft share (logits are cut to it).
    """

    tree: TreeBuffers
    vocab_size: int
    dynamic: DynamicTree | None = None
    sizer: TreeSizer | None = None
    draft: Backend | None = None
    heads: torch.nn.Module | None = None


def plan_tree(config: DecoderConfig, heads_source=None, num_heads: int | None = None,
              ) -> tuple[TreeBuffers, DynamicTree | None]:
    """The verified tree and, for a dynamic tree, its settings.

    A "dynamic..." spec gives a dynamic tree; hydra's default is DEFAULT_HYDRA_TREE, medusa's
    (with tree_budget "auto") DEFAULT_MEDUSA_TREE; a lookup branch of N tokens leaves the heads
    ``rows - N`` nodes (rows: DEFAULT_MAX_ROWS - 1 when sized per step, else DEFAULT_TREE_ROWS).
    A tree method without a tree uses the one shipped next to its heads (``heads_source``), else
    3x2x2x1 cut to the ``num_heads`` heads. mcsd's default is 2x1x1x1; chains have gamma tokens.
    """
    method, tree, sized = config.method, config.tree, config.tree_budget != "fixed"
    dynamic = None
    if config.dynamic_tree:
        dynamic, tree = DynamicTree.parse(tree), None
    elif tree is None and (method in ("hydra", "eagle") or (method == "medusa" and sized)):  # medusa "fixed": static
        dynamic = DynamicTree.parse({"hydra": DEFAULT_HYDRA_TREE, "eagle": DEFAULT_EAGLE_TREE}.get(method,
                                                                                                 DEFAULT_MEDUSA_TREE))
        rows = DEFAULT_MAX_ROWS - 1 if sized else DEFAULT_TREE_ROWS  # the most rows a sized tree may take
        if config.lookup_branch or sized:
            dynamic = dataclasses.replace(dynamic, nodes=max(rows - config.lookup_branch, MIN_DYNAMIC_NODES))
    if method not in ("mcsd", *TREE_METHODS):
        return chain(config.gamma), dynamic
    if method == "eagle":  # grown at every step; the widest static tree its checks need
        return build_tree("x".join(["1"] * (num_heads or 1))), dynamic
    if tree is None and method in TREE_METHODS:  # the tree built for the heads (tree.json next to them)
        tree = heads_tree(heads_source) if not isinstance(heads_source, torch.nn.Module) else None
        if tree is None and num_heads is not None:  # none given or shipped: 3x2x2x1 cut to the heads
            tree = "x".join(map(str, ([3, 2, 2, 1] + [1] * 8)[:num_heads]))
    return build_tree(tree or "2x1x1x1"), dynamic


def target_pass_cost(config: DecoderConfig, target: Backend, target_name: str, target_dtype: torch.dtype) -> PassCost:
    """The target's pass cost by rows: the config's PassCost if it gives one, else this machine's
    curve (measured once and cached)."""
    if isinstance(config.tree_budget, PassCost):
        return config.tree_budget
    runtime = f"{config.backend}:{config.target_quant}:{'packed' if config.backend == 'hf' else 'native'}"
    return pass_cost(target, machine_key(target_name, target_dtype, runtime))


def build_sizer(config: DecoderConfig, dynamic: DynamicTree | None, target: Backend, target_name: str,
                target_dtype: torch.dtype, cost: PassCost | None = None) -> TreeSizer | None:
    """A tree sizer against the target's pass cost by rows (``cost``, else :func:`target_pass_cost`),
    for a dynamic tree or a lookup chain with tree_budget "auto" or a given PassCost; None otherwise."""
    sized = config.tree_budget != "fixed"
    if not sized or not ((dynamic is not None and config.method in NEEDS_HEADS) or config.method == "lookup"):
        return None
    cost = cost if cost is not None else target_pass_cost(config, target, target_name, target_dtype)
    return TreeSizer(cost, max_rows=DEFAULT_MAX_ROWS)


def build_drafter(config: DecoderConfig, parts: DraftParts, sampling: SamplingConfig,
                  generator: torch.Generator | None = None, *, draft: Backend | None = None,
                  own_sizer: bool = False, constraint=None, prediction: torch.Tensor | None = None) -> Drafter:
    """A fresh drafter for one generation (``sampling`` and ``generator``: a draft model's;
    ``constraint``: the generation's grammar, which a draft model's q is masked with;
    ``prediction``: token ids the output is expected to be, searched by prompt lookup (module doc)).
    For a sequence decoded beside others (``batching``): ``draft``, the draft model's backend of
    this sequence (its own KV cache; default ``parts.draft``), and ``own_sizer``, a fork of the
    shared tree sizer (each sequence sizes its own trees)."""
    if own_sizer and parts.sizer is not None:
        parts = dataclasses.replace(parts, sizer=parts.sizer.fork())
    if draft is not None:
        parts = dataclasses.replace(parts, draft=draft)
    method = config.method
    if prediction is not None and not len(prediction):
        prediction = None
    if method == "lookup":
        return LookupDrafter(config.gamma, sizer=parts.sizer, prediction=prediction)
    if prediction is not None and method not in TREE_METHODS:  # ar, bpd, sd, mcsd
        return LookupDrafter(PREDICTION_GAMMA, prediction=prediction)
    if method == "ar":
        return NoDrafter()
    if method in TREE_METHODS:
        gamma = config.lookup_branch or (PREDICTION_GAMMA if prediction is not None else 0)
        lookup = LookupDrafter(gamma, prediction=prediction) if gamma else None
        if method == "eagle":
            from ..eagle import EagleDrafter

            return EagleDrafter(parts.heads, parts.dynamic, parts.vocab_size, lookup, sizer=parts.sizer)
        return MedusaDrafter(parts.heads, parts.tree, parts.vocab_size, lookup, dynamic=parts.dynamic,
                             sizer=parts.sizer)
    if method == "bpd":
        return BlockwiseDrafter(parts.heads, parts.vocab_size, config.gamma)
    return DraftModelDrafter(parts.draft, parts.tree, sampling, parts.vocab_size,
                             replacement=config.replacement, generator=generator, constraint=constraint)


@torch.inference_mode()
def warm_up_heads(heads, vocab_size: int) -> None:
    """Build the heads' low-bit drafting shortlist now rather than in the first generation."""
    proposer_for(heads, vocab_size).warm_up()
