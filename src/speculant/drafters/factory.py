"""Building a decoder's drafter from its (resolved) ``DecoderConfig``.

A decoder prepares once what its drafters share (:class:`DraftParts`: the verified tree, a dynamic
tree's settings, the tree sizer, the draft model's backend, the heads) and builds a fresh drafter
for every generation with :func:`build_drafter`, since a drafter keeps per-sequence state.

The method's row of ``config.METHOD_TABLE`` says which drafter (``Method.drafter``) and tree:

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
from ..config import DEFAULT_MAX_ROWS, DEFAULT_MCSD_TREE, DEFAULT_TREE_ROWS, DecoderConfig, SamplingConfig, is_dynamic
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
    table: object | None = None  # recycle: the decoder's RecycledTable (drafters.recycling)
    answers: object | None = None  # suffix, recycle: the decoder's AnswerStore (drafters.suffix)


def plan_tree(config: DecoderConfig, heads_source=None, num_heads: int | None = None,
              ) -> tuple[TreeBuffers, DynamicTree | None]:
    """The verified tree and, for a dynamic tree, its settings, as the method's row of
    ``config.METHOD_TABLE`` says (``config`` resolved: no "auto").

    A "dynamic..." spec gives a dynamic tree; without a tree, the method's ``default_tree`` (hydra
    DEFAULT_HYDRA_TREE, eagle DEFAULT_EAGLE_TREE, medusa with tree_budget "auto"
    DEFAULT_MEDUSA_TREE, mcsd DEFAULT_MCSD_TREE); a default dynamic tree with a lookup branch of N
    tokens leaves the heads ``rows - N`` nodes (rows: DEFAULT_MAX_ROWS - 1 when sized per step, else
    DEFAULT_TREE_ROWS). A heads tree without one uses the tree shipped next to its heads
    (``heads_source``), else 3x2x2x1 cut to the ``num_heads`` heads; a grown tree's static tree is
    the widest its checks need (a chain of ``num_heads``); chains have gamma tokens.
    """
    spec, tree, sized = config.spec, config.tree, config.tree_budget != "fixed"
    default = spec.default_tree if tree is None and (sized or not spec.default_tree_sized_only) else None
    dynamic = None
    if config.dynamic_tree:
        dynamic, tree = DynamicTree.parse(tree), None
    elif is_dynamic(default):
        dynamic = DynamicTree.parse(default)
        rows = DEFAULT_MAX_ROWS - 1 if sized else DEFAULT_TREE_ROWS  # the most rows a sized tree may take
        if config.lookup_branch or sized:
            dynamic = dataclasses.replace(dynamic, nodes=max(rows - config.lookup_branch, MIN_DYNAMIC_NODES))
    elif default is not None:
        tree = default
    if spec.verifies == "chain":
        return chain(config.gamma), dynamic
    if spec.verifies == "grown":  # grown at every step; the widest static tree its checks need
        return build_tree("x".join(["1"] * (num_heads or 1))), dynamic
    if tree is None and spec.verifies == "heads tree":  # the tree built for the heads (tree.json next to them)
        tree = heads_tree(heads_source) if not isinstance(heads_source, torch.nn.Module) else None
        if tree is None and num_heads is not None:  # none given or shipped: 3x2x2x1 cut to the heads
            tree = "x".join(map(str, ([3, 2, 2, 1] + [1] * 8)[:num_heads]))
    return build_tree(tree or DEFAULT_MCSD_TREE), dynamic


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
    spec = config.spec
    if config.tree_budget == "fixed" or not ((dynamic is not None and spec.heads is not None) or spec.sized_chain):
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
    if prediction is not None and not len(prediction):
        prediction = None
    kind = config.spec.drafter
    if prediction is not None and kind in ("none", "blockwise", "draft model"):  # ar, bpd, sd, mcsd
        return LookupDrafter(PREDICTION_GAMMA, prediction=prediction)
    return _BUILDERS[kind](config, parts, sampling, generator, constraint, prediction)


# One builder per ``Method.drafter``: (config, parts, sampling, generator, constraint, prediction) -> a
# fresh drafter (``prediction``: token ids searched by prompt lookup, or None)

def _no_drafter(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    return NoDrafter()


def _lookup(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    return LookupDrafter(config.gamma, sizer=parts.sizer, prediction=prediction)


def _lookup_branch(config: DecoderConfig, prediction: torch.Tensor | None) -> LookupDrafter | None:
    """The tree's lookup branch: the configured one, or one of PREDICTION_GAMMA tokens for a prediction."""
    gamma = config.lookup_branch or (PREDICTION_GAMMA if prediction is not None else 0)
    return LookupDrafter(gamma, prediction=prediction) if gamma else None


def _heads_tree(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    return MedusaDrafter(parts.heads, parts.tree, parts.vocab_size, _lookup_branch(config, prediction),
                         dynamic=parts.dynamic, sizer=parts.sizer)


def _eagle(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    from ..eagle import EagleDrafter

    return EagleDrafter(parts.heads, parts.dynamic, parts.vocab_size, _lookup_branch(config, prediction),
                        sizer=parts.sizer)


def _blockwise(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    return BlockwiseDrafter(parts.heads, parts.vocab_size, config.gamma)


def _draft_model(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    return DraftModelDrafter(parts.draft, parts.tree, sampling, parts.vocab_size, replacement=config.replacement,
                             generator=generator, constraint=constraint)


def _suffix(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    from .suffix import SuffixDrafter

    return SuffixDrafter(max(config.gamma, 8), parts.answers, sizer=parts.sizer)


def _recycle(config, parts, sampling, generator, constraint, prediction) -> Drafter:
    from .recycling import RecyclingDrafter

    return RecyclingDrafter(parts.table, parts.answers if parts.answers is not None else True,
                            gamma=max(config.gamma, 8), sizer=parts.sizer)


_BUILDERS = {"none": _no_drafter, "lookup": _lookup, "suffix": _suffix, "recycle": _recycle, "heads tree": _heads_tree,
             "eagle": _eagle, "blockwise": _blockwise, "draft model": _draft_model}


@torch.inference_mode()
def warm_up_heads(heads, vocab_size: int) -> None:
    """Build the heads' low-bit drafting shortlist now rather than in the first generation."""
    proposer_for(heads, vocab_size).warm_up()
