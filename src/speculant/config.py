"""Frozen configuration dataclasses. Validation happens at construction, with messages that
say what was wrong and how to fix it (raised as ConfigError)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

# The prompt-lookup chain of the bench's medusa+lookup / hydra+lookup (--lookup-branch). Measured
# on 52 Spec-Bench prompts the bench does not use (questions 3-6 of each of the 13 categories),
# teacher-forced on the target's own greedy text (deterministic): tau of hydra+lookup at 29 rows
# is 2.268 with a 4-token chain, 2.334 with 8, 2.342 with 12 (summaries 2.87 -> 3.63); medusa's
# static 14-node tree + the chain, 1.925 with 4, 1.999 with 12. (First version of the replay; the
# shipped tools/teacher_forced_tau.py stops counting at each text's end: 2.238 with 4, 2.309 with 12.)
# At hydra's 16-row default (api.DEFAULT_TREE_ROWS, packed bf16 weights), the shipped tool gives
# 2.134 with a 4-token chain (11 heads' nodes), 2.167 with 6, 2.173 with 8 (7 nodes), 2.171 with 9,
# 2.163 with 10, 2.135 with 12: 8.
DEFAULT_LOOKUP_BRANCH = 8


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution; applied identically to draft and target.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    seed: makes a sampled run reproducible (None = nondeterministic).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (1 disables nucleus filtering), got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables top-k filtering), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


ACCEPT_RULES = ("exact", "typical", "topk", "distance")


@dataclass(frozen=True)
class AcceptanceConfig:
    """Which acceptance rule the loop uses. ``exact`` (the default) is lossless; the others are the
    approximate rules of ``speculant.acceptance.approx`` and may change the output (the stats say which ran).

    typical: Medusa's typical acceptance, accept x if p(x) > min(eps, delta * exp(-H(p)))
    (defaults eps=0.09, delta=0.3 as in Medusa); at temperature 0 it is exactly greedy.
    topk: accept x if it is among the target's ``k_top`` most likely tokens (BPD).
    distance: accept x if ||E[x] - E[argmax p]|| <= eps, E the target's input embeddings (BPD).
    min_block: accept the first ``min_block`` drafted tokens of the chosen path whatever the rule
    says (BPD's minimum block size ℓ is min_block + 1 tokens per step); 0 = off. Any rule.
    """

    rule: str = "exact"
    eps: float | None = None  # typical: 0.09; distance: required
    delta: float = 0.3
    k_top: int = 2
    min_block: int = 0

    def __post_init__(self) -> None:
        if self.rule not in ACCEPT_RULES:
            raise ConfigError(f"unknown acceptance rule {self.rule!r}: choose one of {', '.join(ACCEPT_RULES)}")
        if self.rule == "typical":
            eps = 0.09 if self.eps is None else self.eps
            if not 0 < eps < 1:
                raise ConfigError(f"typical acceptance eps must be in (0, 1), got {eps}")
            if not self.delta > 0:
                raise ConfigError(f"typical acceptance delta must be > 0, got {self.delta}")
        if self.rule == "distance" and (self.eps is None or not self.eps >= 0):
            raise ConfigError("distance acceptance needs eps >= 0 (the largest embedding distance to the "
                              f"target's argmax that is accepted), got {self.eps}")
        if self.rule == "topk" and self.k_top < 1:
            raise ConfigError(f"top-k acceptance needs k_top >= 1, got {self.k_top}")
        if self.min_block < 0:
            raise ConfigError(f"min_block must be >= 0, got {self.min_block}")

    @property
    def exact(self) -> bool:
        return self.rule == "exact" and self.min_block == 0

    @property
    def label(self) -> str:
        """A short name for stats and bench rows, e.g. ``typical(0.09,0.3)``, ``topk(2)+min2``."""
        if self.rule == "typical":
            base = f"typical({0.09 if self.eps is None else self.eps:g},{self.delta:g})"
        elif self.rule == "topk":
            base = f"topk({self.k_top})"
        elif self.rule == "distance":
            base = f"distance({self.eps:g})"
        else:
            base = "exact"
        return base + (f"+min{self.min_block}" if self.min_block else "")


def parse_acceptance(spec: str | AcceptanceConfig) -> AcceptanceConfig:
    """``exact`` | ``typical[=EPS[/DELTA]]`` | ``topk[=K]`` | ``dist=EPS``, optionally ``+min=M``;
    e.g. ``typical``, ``typical=0.05/0.2``, ``topk=3+min=1``, ``dist=0.5``, ``min=2``."""
    if isinstance(spec, AcceptanceConfig):
        return spec
    kw: dict = {}
    for part in str(spec).replace(" ", "").split("+"):
        name, _, value = part.partition("=")
        try:
            if name == "exact" and not value:
                kw.setdefault("rule", "exact")
            elif name == "typical":
                kw["rule"] = "typical"
                if value:
                    eps, _, delta = value.partition("/")
                    kw["eps"] = float(eps)
                    if delta:
                        kw["delta"] = float(delta)
            elif name == "topk":
                kw["rule"], kw["k_top"] = "topk", int(value) if value else 2
            elif name in ("dist", "distance") and value:
                kw["rule"], kw["eps"] = "distance", float(value)
            elif name == "min" and value:
                kw["min_block"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"cannot read acceptance rule {part!r} in {spec!r}: use exact, typical[=EPS[/DELTA]], "
                              "topk[=K], dist=EPS, optionally +min=M (e.g. topk=2+min=1)") from None
    return AcceptanceConfig(**kw)
