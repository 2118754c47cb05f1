"""Which shipped drafter method "auto" decodes with when a model has more than one: the one the
cost model forecasts fastest on this machine.

A candidate's first d guesses are all the target's own tokens with held-out probability a_d
(measured for every candidate on the same held-out positions: ``accuracy.json`` beside the EAGLE
drafter, written by ``tools/drafter_accuracy.py``). Drafting D depths and verifying that chain
then returns, per step,

    E(D) = 1 + Σ_{d<=D} a_d  tokens,   at   T(D) = cost(1 + D, L) + draft(D)  milliseconds

(cost: the target's measured pass cost by rows at context L, ``costmodel.PassCost``; draft(D):
the drafter's time to draft D depths of its own tree, measured here at load). A candidate's
forecast is its best E / T over D; the larger forecast wins. The chain is a floor for both
candidates alike: their trees, sized per step by the same ``TreeSizer``, add side branches to it.
None of this can change the output, only the speed.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..backends.base import HiddenNeed
from ..costmodel import PassCost
from .base import Drafter

__all__ = ["ACCURACY_FILE", "Forecast", "choose_drafter", "held_out_accuracy", "time_drafting"]

ACCURACY_FILE = "accuracy.json"
FORECAST_CONTEXT = 512  # the context (tokens) the forecast prices a pass at: a prompt and an answer


@dataclass(frozen=True)
class Forecast:
    """What the cost model knows of one candidate on this machine.

    method: "hydra" | "eagle" (what ``DecoderConfig.method`` becomes). accuracy: held-out
    P(the first d guesses are all right), d = 1, 2, ... draft_ms: measured ms to draft 1, 2, ...
    depths. Only depths with both are used.
    """

    method: str
    accuracy: tuple[float, ...]
    draft_ms: tuple[float, ...]

    def best(self, cost: PassCost, context: int = FORECAST_CONTEXT) -> tuple[float, int]:
        """(expected tokens per ms, chain depth D) of the best depth; D = 0: plain decoding."""
        rate, depth, tokens = 1.0 / cost(1, context), 0, 1.0
        for d, (a, ms) in enumerate(zip(self.accuracy, self.draft_ms), start=1):
            tokens += a
            r = tokens / (cost(1 + d, context) + ms)
            if r > rate:
                rate, depth = r, d
        return rate, depth


def held_out_accuracy(path: str | Path) -> dict[str, tuple[float, ...]]:
    """The greedy-chain held-out accuracy by depth of each kind of drafter ("hydra", "eagle"),
    from ``path/accuracy.json``; {} when the file is missing or holds none."""
    f = Path(path) / ACCURACY_FILE
    try:
        data = json.loads(f.read_text())
        return {e["kind"]: tuple(float(a) for a in e["greedy"]) for e in data.get("drafters", [])
                if isinstance(e, dict) and e.get("kind") and e.get("greedy")}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


@torch.inference_mode()
def time_drafting(drafter: Drafter, prompt: torch.Tensor, hidden: torch.Tensor, repeats: int = 5) -> tuple[float, ...]:
    """Milliseconds ``drafter`` (a dynamic-tree drafter without a sizer) takes to draft its tree
    1, 2, ... ``drafter.depth`` depths deep after ``prompt`` (T,), given target states ``hidden``
    (T-1, H) at ``prompt[:-1]``; the fastest of ``repeats`` tries of each (timing noise only adds)."""
    states = hidden if drafter.hidden_need is HiddenNeed.ALL else hidden[-1]
    deepest, out = drafter.depth, []
    try:
        for d in range(1, deepest + 1):
            drafter.depth = d
            drafter.begin(prompt, states)
            best = math.inf
            for _ in range(repeats):
                t = time.perf_counter()
                drafter.propose(prompt)
                best = min(best, (time.perf_counter() - t) * 1e3)
            out.append(best)
    finally:
        drafter.depth = deepest
    return tuple(out)


def choose_drafter(forecasts: Sequence[Forecast], cost: PassCost,
                   context: int = FORECAST_CONTEXT) -> tuple[Forecast, str]:
    """The candidate with the most expected tokens per ms (ties: the earlier one), and one plain
    clause saying why, e.g. "the cost model forecasts 31.2 tokens/s for it (chains of 3) against 29.8
    for hydra on this CPU"."""
    if not forecasts:
        raise ValueError("no drafter to choose from")
    rated = [(f, *f.best(cost, context)) for f in forecasts]
    best = max(rated, key=lambda r: r[1])  # max keeps the first of equals
    others = ", ".join(f"{1e3 * r:.1f} for {f.method}" for f, r, _ in rated if f is not best[0])
    return best[0], (f"the cost model forecasts {1e3 * best[1]:.1f} tokens/s for it (chains of {best[2]})"
                     + (f" against {others}" if others else "") + " on this CPU")
