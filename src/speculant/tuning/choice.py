"""Which shipped drafter method "auto" decodes with when a model has more than one: the one the
cost model forecasts fastest on this machine.

For every candidate, ``accuracy.json`` beside the EAGLE drafter (written by
``speculant drafter-accuracy``, every candidate on the same held-out positions) holds A(d, m): the
mean number of draft tokens the target accepts from the drafter's own tree grown d depths deep
and cut to its m best-scored nodes (the tree a decoding step verifies, before the lookup chain
joins it). Such a step costs

    T(d, m) = cost(1 + m, L) + draft(d)  milliseconds, and returns 1 + A(d, m) tokens

(cost: the target's measured pass cost by rows at context L, ``tuning.costmodel.PassCost``; draft(d):
the drafter's time per step with its tree d depths deep, measured here at load from cold caches,
as decoding runs it). A candidate's forecast is its best (1 + A) / T over (d, m), the sizer's rule
(``sizing.TreeSizer``), on text like what users ask: the shipped file is measured on the target's
answers to the Spec-Bench questions the bench does not use (on their own corpora's held-out text
the drafters are accepted far more often, the EAGLE drafter the more so). The larger forecast
wins; a tie keeps the first candidate (the heads). A file with only
the greedy chain's accuracy a_d (P(first d guesses all right)) gives A(d, m) = a_1 + ... +
a_min(d, m): a chain of m <= d nodes. None of this can change the output, only the speed.
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
from .costmodel import PassCost
from ..drafters.base import Drafter

__all__ = ["ACCURACY_FILE", "CacheSweep", "Forecast", "chain_accepts", "choose_drafter",
           "held_out_accepts", "last_level_cache_bytes", "time_drafting", "tree_accepts"]

ACCURACY_FILE = "accuracy.json"
FORECAST_CONTEXT = 512  # the context (tokens) the forecast prices a pass at: a prompt and an answer


@dataclass(frozen=True)
class Forecast:
    """What the cost model knows of one candidate on this machine.

    method: "hydra" | "eagle" (what ``DecoderConfig.method`` becomes). accepts: A(d, m) as
    ``accepts[d-1][m-1]`` (module doc). draft_ms: measured ms per step with the tree 1, 2, ...
    depths deep. Only depths with both are used.
    """

    method: str
    accepts: tuple[tuple[float, ...], ...]
    draft_ms: tuple[float, ...]

    def best(self, cost: PassCost, context: int = FORECAST_CONTEXT) -> tuple[float, tuple[int, int]]:
        """(expected tokens per ms, (depth, nodes)) of the best tree; (0, 0): plain decoding."""
        rate, shape = 1.0 / cost(1, context), (0, 0)
        for d, (row, ms) in enumerate(zip(self.accepts, self.draft_ms), start=1):
            for m, a in enumerate(row, start=1):
                r = (1.0 + a) / (cost(1 + m, context) + ms)
                if r > rate:
                    rate, shape = r, (d, m)
        return rate, shape


def chain_accepts(accuracy: Sequence[float]) -> tuple[tuple[float, ...], ...]:
    """A(d, m) of a greedy chain from its accuracy by depth a_d = P(first d guesses all right):
    a_1 + ... + a_min(d, m), for m <= d nodes."""
    sums = [sum(accuracy[:m]) for m in range(1, len(accuracy) + 1)]
    return tuple(tuple(sums[:d]) for d in range(1, len(accuracy) + 1))


def held_out_accepts(path: str | Path) -> dict[str, tuple[tuple[float, ...], ...]]:
    """A(d, m) of each kind of drafter ("hydra", "eagle") from ``path/accuracy.json``: its "tree"
    table, else its greedy chain's; {} when the file is missing or holds none."""
    f = Path(path) / ACCURACY_FILE
    try:
        out = {}
        for e in json.loads(f.read_text()).get("drafters", []):
            if not (isinstance(e, dict) and e.get("kind")):
                continue
            if e.get("tree"):
                out[e["kind"]] = tuple(tuple(float(a) for a in row) for row in e["tree"])
            elif e.get("greedy"):
                out[e["kind"]] = chain_accepts([float(a) for a in e["greedy"]])
        return out
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The size of this CPU's largest cache (Linux's sysfs), ``default`` where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


class CacheSweep:
    """Reads a buffer twice the size of the CPU's largest cache: what a pass of the target does to
    the drafter's weights between two decoding steps (it streams far more than the caches hold),
    so drafting timed after a sweep is priced as decoding runs it, from memory."""

    def __init__(self, nbytes: int | None = None):
        n = (nbytes or min(2 * last_level_cache_bytes(), 512 << 20)) // 4
        self.buffer = torch.ones(max(n, 1024), dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.sum()


@torch.inference_mode()
def time_drafting(drafter: Drafter, prompt: torch.Tensor, hidden: torch.Tensor, repeats: int = 5,
                  sweep: CacheSweep | None = None) -> tuple[float, ...]:
    """Milliseconds of one decoding step's drafting by ``drafter`` (a dynamic-tree drafter without
    a sizer) with its tree 1, 2, ... ``drafter.depth`` depths deep, after ``prompt`` (T,) given
    target states ``hidden`` (T-1, H) at ``prompt[:-1]``: proposing the tree, then taking in the
    accepted position (``observe``; the EAGLE drafter runs its layer over it). Each try starts
    from cold caches (``sweep``, default a :class:`CacheSweep`: in decoding the target's pass runs
    between two drafting steps); the fastest of ``repeats`` tries of each (timing noise only adds)."""
    sweep = sweep or CacheSweep()
    full = drafter.hidden_need is HiddenNeed.ALL
    states = hidden if full else hidden[-1]
    accepted = hidden[-1:] if full else hidden[-1]  # the root's state, as the target returns it
    root = int(prompt[-1])
    deepest, out = drafter.depth, []
    try:
        for d in range(1, deepest + 1):
            drafter.depth = d
            drafter.begin(prompt, states)
            best = math.inf
            for _ in range(repeats):
                sweep()
                t = time.perf_counter()
                drafter.propose(prompt)
                drafter.observe([0], root, accepted)
                best = min(best, (time.perf_counter() - t) * 1e3)
            out.append(best)
    finally:
        drafter.depth = deepest
    return tuple(out)


@torch.no_grad()
def tree_accepts(drafter, records: Sequence[dict], hidden: torch.Tensor, starts: torch.Tensor,
                 positions: Sequence[Sequence[int]]) -> list[list[float]]:
    """A(d, m) (module doc) of a dynamic-tree drafter (``DynamicTreeDrafter``, e.g. ``EagleDrafter``'s,
    without a sizer or lookup chain), measured on text the target wrote: at each position i of
    ``positions[r]`` in ``records[r]["ids"]``, the drafter grows its tree from the target's state
    there (``hidden[starts[r] + i]``, (H,), the state whose output is token i + 1) and root token
    i + 1, and a node counts while its whole path matches the tokens that follow. Returns
    ``[d-1][m-1]``: the mean, over positions, of the deepest such node among the best m of depth <= d."""
    from ..eagle import EagleCache
    from ..eagle.drafter import EagleSteps
    from ..drafters.proposers import Stepwise

    steps = drafter.proposer.source if isinstance(drafter.proposer, Stepwise) else None
    eagle = isinstance(steps, EagleSteps)
    D, M = drafter.depth, drafter.dynamic.nodes
    sums, total = [[0.0] * M for _ in range(D)], 0
    for r, (rec, sampled) in enumerate(zip(records, positions)):
        ids, s, L = rec["ids"], int(starts[r]), len(rec["ids"])
        if eagle:  # the committed pairs' features, as decoding computes them
            cache = EagleCache()
            feats = steps.model.extend(cache, hidden[s:s + L - 1], torch.tensor(ids[1:L]))
        for i in sampled:
            total += 1
            if eagle:
                steps.cache, state = cache.prefix(i + 1), feats[i]
            else:
                state = hidden[s + i].float()
            paths, tokens, _ = drafter.grow_scored(state, torch.tensor([ids[i + 1]]), 10 ** 6)  # all, best first
            right = {(): True}  # a node's parent comes before it in the list
            for p, t in zip(paths, tokens.tolist()):
                at = i + 1 + len(p)
                right[p] = right.get(p[:-1], False) and at < L and t == ids[at]
            for d in range(1, D + 1):
                kept = [p for p in paths if len(p) <= d][:M]
                deepest = 0
                for m in range(M):
                    if m < len(kept) and right[kept[m]]:
                        deepest = max(deepest, len(kept[m]))
                    sums[d - 1][m] += deepest
    return [[x / max(total, 1) for x in row] for row in sums]


def choose_drafter(forecasts: Sequence[Forecast], cost: PassCost,
                   context: int = FORECAST_CONTEXT) -> tuple[Forecast, str]:
    """The candidate with the most expected tokens per ms (the first of equals), and one plain
    clause saying why, e.g. "the cost model forecasts 31.2 tokens/s for it (6-node trees, 3 deep)
    against 29.8 for hydra on this CPU"."""
    if not forecasts:
        raise ValueError("no drafter to choose from")
    rated = [(f, *f.best(cost, context)) for f in forecasts]
    best, rate, (depth, nodes) = max(rated, key=lambda r: r[1])  # max keeps the first of equals
    others = ", ".join(f"{1e3 * r:.1f} for {f.method}" for f, r, _ in rated if f is not best)
    return best, (f"the cost model forecasts {1e3 * rate:.1f} tokens/s for it ({nodes}-node trees, {depth} deep)"
                  + (f" against {others}" if others else "") + " on this CPU")
