"""One place decides what runs: :func:`plan` turns a decoder's config, once its target has loaded,
into a :class:`Plan` — the method, the drafter's source (and the drafter loaded), the verified
tree, the tree sizer and the reasons for each choice, from which the decoder's one-line ``why``
is rendered.

What "auto" takes (why each default is what it is: docs/design-notes.md):

runtime   chosen before the target loads, from its config alone (``defaults.choose_runtime``):
          speculant's native int4 runtime for its families, transformers otherwise.
method    with a draft model: ``sd``; with heads shipped for the target: ``hydra`` with an
          8-token prompt-lookup branch, its tree sized at every step against this machine's
          measured pass cost; where an EAGLE drafter ships beside the heads (with held-out
          accuracies for both), ``eagle`` instead if the cost model forecasts it faster on this
          CPU (:func:`compare_shipped_drafters`, ``tuning.choice``); otherwise prompt
          ``lookup``, its chain sized the same way. Every drafting method runs under a
          ``tuning.pacing.Pacer``, which verifies the root alone while drafting does not pay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .config import AUTO, DEFAULT_LOOKUP_BRANCH, METHOD_TABLE, DecoderConfig
from .tuning.costmodel import PassCost
from .defaults import Runtime

__all__ = ["AUTO_LOOKUP_BRANCH", "AUTO_LOOKUP_GAMMA", "DEFAULT_GAMMA", "MethodChoice", "Plan", "choose_method",
           "compare_shipped_drafters", "plan"]

AUTO_LOOKUP_BRANCH = DEFAULT_LOOKUP_BRANCH  # hydra+lookup's chain
# the heads methods "auto" takes where their drafters ship for the target: the first by default,
# another where the cost model forecasts it faster (the held-out accuracies ship beside the last)
AUTO_HEADS = ("hydra", "eagle")
AUTO_LOOKUP_GAMMA = 8  # lookup's longest chain when sized per step
DEFAULT_GAMMA = 4  # sd's chain, bpd's and a fixed lookup chain's length


@dataclass(frozen=True)
class Plan:
    """What a decoder runs. ``config``: resolved (no "auto" left); ``runtime``: the runtime chosen
    before the target loaded; ``heads_source``: where the heads (or EAGLE drafter) come from, None
    for methods without; ``heads``: them loaded (or None); ``tree`` (TreeBuffers) / ``dynamic``
    (DynamicTree or None): the verified tree; ``sizer``: the TreeSizer sizing each step's tree
    against ``cost`` (None when trees are not sized); ``reasons``: why, one clause per choice."""

    config: DecoderConfig
    runtime: Runtime
    heads_source: Any
    heads: torch.nn.Module | None
    tree: Any
    dynamic: Any
    sizer: Any
    cost: PassCost | None
    reasons: tuple[str, ...]

    @property
    def why(self) -> str:
        """The reasons as one plain line ("" when nothing was chosen)."""
        return "; ".join(r for r in self.reasons if r)


class MethodChoice(NamedTuple):
    """"auto"'s method before the drafters are compared: ``method``, ``lookup_branch``, ``why``."""

    method: str
    lookup_branch: int
    why: str


def _heads_why(method: str, lookup_branch: int) -> str:
    """What "auto" says of a heads method it took."""
    lookup = " plus prompt lookup" if lookup_branch else ""
    return (f"{method}{'+lookup' if lookup_branch else ''} ({METHOD_TABLE[method].label} shipped for this "
            f"model{lookup}; each step's tree sized against this CPU's measured pass cost, drafting paused while it "
            "does not pay)")


def choose_method(method: str, target_name: str, has_draft: bool, lookup_branch: int) -> MethodChoice:
    """The method for ``method`` "auto" from what ships for the target (anything else passes
    through with no reason)."""
    from .store.loading import shipped_drafter

    if method != AUTO:
        return MethodChoice(method, lookup_branch, "")
    if has_draft:
        return MethodChoice("sd", 0, "sd with the given draft model, drafting paused while it does not pay")
    if shipped_drafter(target_name, AUTO_HEADS[0]) is not None:
        lookup_branch = lookup_branch or AUTO_LOOKUP_BRANCH
        return MethodChoice(AUTO_HEADS[0], lookup_branch, _heads_why(AUTO_HEADS[0], lookup_branch))
    return MethodChoice("lookup", 0, "prompt lookup (no heads ship for this model; the chain sized against this "
                                     "CPU's measured pass cost, drafting paused while it does not pay)")


def compare_shipped_drafters(config: DecoderConfig, target, backend, price: Callable[[], PassCost]):
    """For a config "auto" gave ``AUTO_HEADS[0]`` (its heads ship for the target): where the
    drafters of every method of AUTO_HEADS ship, with held-out accuracies for each (beside the
    last, ``tuning.choice``), the one the cost model forecasts faster here. ``target``: the
    LoadedModel; ``backend``: its Backend; ``price()``: its PassCost, asked for only when there is
    a choice to make. Returns (method, reason, that drafter loaded, the PassCost), or None when
    there is nothing to compare."""
    from .config import SamplingConfig
    from .tuning.choice import CacheSweep, Forecast, choose_drafter, held_out_accepts, time_drafting
    from .drafters.factory import DraftParts, build_drafter, plan_tree, warm_up_heads
    from .drafters.proposers import draft_depth
    from .store.loading import load_decoder_heads, shipped_drafter

    sources = {m: shipped_drafter(target.name, m) for m in AUTO_HEADS}
    if config.method != AUTO_HEADS[0] or config.heads is not None or not (config.tree is None or config.dynamic_tree) \
            or any(source is None for source in sources.values()):
        return None
    accepts = held_out_accepts(sources[AUTO_HEADS[-1]])
    if any(m not in accepts for m in sources):
        return None
    V = backend.vocab_size
    prompt = torch.arange(64, dtype=torch.long) % V  # any tokens: only the drafting time is read
    hidden = target.model.get_input_embeddings().weight[prompt[:-1]].detach()  # (T-1, H), a plausible scale
    forecasts, loaded, sweep = [], {}, CacheSweep()  # one buffer for every drafter's timing
    for method, source in sources.items():
        heads = load_decoder_heads(source, target.model, method)
        tree, dynamic = plan_tree(dataclasses.replace(config, method=method), source, draft_depth(heads))
        warm_up_heads(heads, V)
        timing = dataclasses.replace(config, method=method, lookup_branch=0)  # the chain costs both the same
        drafter = build_drafter(timing, DraftParts(tree, V, dynamic, heads=heads), SamplingConfig())
        table = tuple(row[:dynamic.nodes] for row in accepts[method])  # the nodes the lookup chain leaves
        states = hidden.repeat(1, 1 + len(drafter.hidden_layers))  # (T-1, W): the fused layers' states too
        forecasts.append(Forecast(method, table, time_drafting(drafter, prompt, states, sweep=sweep)))
        loaded[method] = heads
    cost = price()
    chosen, reason = choose_drafter(forecasts, cost)
    return chosen.method, reason, loaded[chosen.method], cost


def plan(config: DecoderConfig, runtime: Runtime, target, backend) -> Plan:
    """The :class:`Plan` of ``config`` (its runtime already resolved: ``defaults.resolve_runtime``)
    for the loaded ``target`` (a LoadedModel) on ``backend`` (its Backend). Loads the heads a heads
    method reads and measures (or reads the cached) pass cost a sized tree needs."""
    from .drafters.factory import build_sizer, plan_tree, target_pass_cost
    from .drafters.proposers import draft_depth
    from .store.loading import find_heads, load_decoder_heads

    auto = config.method == AUTO
    reasons = [runtime.why]
    if config.lora is not None:
        reasons.append(f"LoRA adapter {config.lora} merged into the target")
    choice = choose_method(config.method, target.name, config.draft is not None, config.lookup_branch)
    gamma = config.gamma
    if gamma is None:
        sized_lookup = auto and METHOD_TABLE[choice.method].sized_chain and config.tree_budget != "fixed"
        gamma = AUTO_LOOKUP_GAMMA if sized_lookup else DEFAULT_GAMMA
    c = dataclasses.replace(config, method=choice.method, lookup_branch=choice.lookup_branch, gamma=gamma)

    def price() -> PassCost:
        return target_pass_cost(c, backend, target.name, target.dtype)

    heads, cost, method_why = None, None, [choice.why]
    if auto:
        compared = compare_shipped_drafters(c, target, backend, price)
        if compared is not None:
            method, reason, heads, cost = compared
            c = dataclasses.replace(c, method=method)
            method_why = [_heads_why(method, c.lookup_branch), reason]
    reasons += method_why
    heads_source = find_heads(c, target.name)
    if heads is None and c.spec.heads is not None:
        heads = load_decoder_heads(heads_source, target.model, c.method)
    tree, dynamic = plan_tree(c, heads_source, draft_depth(heads) if heads is not None else None)
    sizer = build_sizer(c, dynamic, backend, target.name, target.dtype, cost)
    if sizer is not None:
        cost = sizer.cost
    return Plan(c, runtime, heads_source, heads, tree, dynamic, sizer, cost, tuple(r for r in reasons if r))
