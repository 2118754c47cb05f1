"""Frozen configuration dataclasses. Validation happens at construction, with messages that
say what was wrong and how to fix it (raised as ConfigError).

Method             what one decoding method runs and needs: a row of METHOD_TABLE, read by the
                   drafter factory, the loaders and the planner
SamplingConfig     how logits become a distribution (temperature, top-k, top-p, seed)
AcceptanceConfig   which acceptance rule the loop runs (exact by default)
DecoderConfig      everything a ``SpeculativeDecoder`` is built from (method, models, tree, runtime)
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import ConfigError
from .penalties import Penalties

BACKENDS = ("auto", "hf", "native")
TREE_BUDGETS = ("auto", "fixed")
AUTO = "auto"  # the method chosen per target and machine by ``planning.plan``: no row of METHOD_TABLE

# Why 8 tokens: docs/design-notes.md#lookup-branch-length
DEFAULT_LOOKUP_BRANCH = 8  # the prompt-lookup chain of medusa+lookup / hydra+lookup (--lookup-branch)
# hydra's default: 15 nodes, depth <= 2, grown per step from the heads' probabilities (the static tree
# shipped next to the heads stays available through --tree-file). Why depth 2: docs/design-notes.md#hydra-tree-depth
DEFAULT_HYDRA_TREE = "dynamic:15:2"
# eagle's default: EAGLE-2's dynamic tree as deep as the drafter is trained for, sized per step
DEFAULT_EAGLE_TREE = "dynamic"
# A fixed-size step verifies 1 + DEFAULT_TREE_ROWS rows; with a lookup branch of N tokens merged into
# hydra's dynamic tree the heads get DEFAULT_TREE_ROWS - N nodes. Why 16 rows: docs/design-notes.md#tree-rows
DEFAULT_TREE_ROWS = 15
# tree_budget="auto" (the default for dynamic trees): every step's tree is sized against the measured
# cost of a pass by rows (tuning/costmodel.py, tuning/sizing.py), up to this many rows
DEFAULT_MAX_ROWS = 32
MAX_GAMMA = 64  # the longest draft chain (sd, lookup, bpd) a step may verify
# medusa's default with tree_budget="auto": a dynamic tree as deep as the heads go, sized per step, at
# most DEFAULT_MAX_ROWS - 1 - lookup_branch nodes; "fixed" keeps the static tree shipped with the heads.
# Why: docs/design-notes.md#medusa-tree-sized-per-step
DEFAULT_MEDUSA_TREE = "dynamic"
DEFAULT_MCSD_TREE = "2x1x1x1"  # mcsd's k-config, and any tree method's last resort
# sampling temperatures outside these bounds would overflow (or flatten) logits / temperature in float32
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30


@dataclass(frozen=True)
class Method:
    """What one value of ``DecoderConfig.method`` runs and needs: a row of :data:`METHOD_TABLE`,
    the one place that says it (the factory, the loaders and the planner read it).

    label: what drafts, in the words "auto" explains itself with ("the heads", "prompt lookup").
    drafter: the drafter ``drafters.factory`` builds: "none" (plain decoding), "lookup", "heads tree"
    (``MedusaDrafter``), "eagle" (``EagleDrafter``), "blockwise" (``BlockwiseDrafter``) or "draft
    model" (``DraftModelDrafter``).
    verifies: what a step verifies: "chain" (gamma tokens), "k-config" (a draft model's tree),
    "heads tree" (a static tree or one grown per step from heads, optionally with a prompt-lookup
    branch) or "grown" (only a tree grown per step, optionally with the branch).
    needs_draft: a draft model (``draft=``). heads: the kind of drafter it reads beside the target,
    None for none: "medusa" or "sequential" heads (``HeadsConfig.kind``), "eagle" an EAGLE drafter.
    missing_heads: what a ConfigError says after "method NAME needs " when none is given and none
    ships (``{target}``: the target's name).
    default_tree: the tree verified when none is given ("dynamic...": grown per step; None: the
    chain, or the static tree shipped next to the heads); ``default_tree_sized_only``: only while
    trees are sized per step (tree_budget "auto"), else that static tree.
    sized_chain: its chain sized per step against the pass cost (tree_budget "auto").
    """

    name: str
    label: str
    drafter: str
    verifies: str = "chain"
    needs_draft: bool = False
    heads: str | None = None
    missing_heads: str = ""
    default_tree: str | None = None
    default_tree_sized_only: bool = False
    sized_chain: bool = False

    @property
    def drafts(self) -> bool:
        """Whether it drafts at all (plain decoding does not: nothing to pace, nothing accepted)."""
        return self.drafter != "none"

    @property
    def tree_from_heads(self) -> bool:
        """Whether its heads' proposals are verified as a token tree (a dynamic tree and a
        prompt-lookup branch are its options)."""
        return self.verifies in ("heads tree", "grown")


def _heads_missing(kind: str) -> str:
    return (f"{kind} heads and none ship for {{target!r}}: pass heads=DIR (--heads DIR), a heads directory "
            f"(train some with `speculant train-heads --head-kind {kind}`)")


METHOD_TABLE: dict[str, Method] = {m.name: m for m in (
    Method("ar", "plain decoding", "none"),
    Method("sd", "the draft model", "draft model", needs_draft=True),
    Method("mcsd", "the draft model", "draft model", "k-config", needs_draft=True, default_tree=DEFAULT_MCSD_TREE),
    Method("lookup", "prompt lookup", "lookup", sized_chain=True),
    Method("suffix", "suffix matches", "suffix", sized_chain=True),
    Method("recycle", "recycled predictions", "recycle", sized_chain=True),
    Method("medusa", "the heads", "heads tree", "heads tree", heads="medusa", missing_heads=_heads_missing("medusa"),
           default_tree=DEFAULT_MEDUSA_TREE, default_tree_sized_only=True),
    Method("hydra", "the heads", "heads tree", "heads tree", heads="sequential",
           missing_heads=_heads_missing("sequential"), default_tree=DEFAULT_HYDRA_TREE),
    Method("eagle", "the EAGLE drafter", "eagle", "grown", heads="eagle",
           missing_heads="an EAGLE drafter and none ships for {target!r}: pass heads=DIR (--heads DIR), a directory "
                         "written by speculant's EAGLE training (speculant train-eagle)",
           default_tree=DEFAULT_EAGLE_TREE),
    Method("bpd", "the heads", "blockwise", heads="medusa", missing_heads=_heads_missing("medusa")),
)}
METHODS = (AUTO, *METHOD_TABLE)


def method_reading(kind: str) -> str:
    """The first method of :data:`METHOD_TABLE` that reads heads of ``kind`` (what to suggest for them)."""
    return next(m.name for m in METHOD_TABLE.values() if m.heads == kind)


def is_dynamic(tree: Any) -> bool:
    """Whether a tree spec asks for a tree grown per step ("dynamic...")."""
    return isinstance(tree, str) and tree.strip().lower().startswith("dynamic")



@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution; applied identically to draft and target.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    seed: makes a sampled run reproducible (None = nondeterministic). min_p: keep the tokens at
    least min_p times as likely as the most likely one (0 = off).
    penalties: presence / frequency / repetition penalties and logit bias
    (:class:`~speculant.penalties.Penalties`), applied to the target's logits at every verified
    node before the rest (the target's distribution is the penalised one; drafts need none).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    penalties: Penalties = field(default_factory=Penalties)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} "
                              f"(logits / temperature must stay finite), got {self.temperature}")
        if self.seed is not None:
            try:
                seed = operator.index(self.seed)
            except TypeError:
                raise ConfigError(f"seed must be an integer (or None), got {self.seed!r}") from None
            if not -2**63 <= seed < 2**64:
                raise ConfigError(f"seed must be an integer from -2**63 to 2**64 - 1 (or None), got {seed}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (1 disables nucleus filtering), got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables top-k filtering), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")

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


@dataclass(frozen=True)
class DecoderConfig:
    """Everything a :class:`~speculant.api.SpeculativeDecoder` is built from, checked at construction.

    target / draft: a spec for ``speculant.load`` (directory, .gguf, preset) or a ``LoadedModel``.
    method: "auto" (the fastest lossless setup for the target, ``planning.plan``), "ar"
    (plain decoding), "sd" (a draft chain of ``gamma`` tokens), "mcsd" (a draft token tree, the
    k-config ``tree`` like "4x2x2x1", candidates sampled with or without ``replacement``),
    "lookup" (n-gram prompt lookup, a chain of up to ``gamma`` tokens), "medusa" / "hydra" (heads
    on the target's hidden state propose a tree; hydra's heads are sequential), "bpd" (blockwise
    parallel decoding: the heads' top-1 tokens as a chain of ``gamma`` <= K). What each needs and
    runs: its row of :data:`METHOD_TABLE` (``spec``).
    gamma: draft length (default 4; 8 for an automatically chosen, sized lookup chain).
    tree: a k-config, a list of paths, or for medusa/hydra "dynamic", "dynamic:N", "dynamic:N:D"
    (a tree of N nodes and depth D grown per step, ``drafters.medusa.DynamicTree``).
    heads: a heads directory or heads module (default: the heads shipped for the target preset).
    lookup_branch: medusa/hydra only, N > 0 adds a prompt-lookup chain of N tokens to the tree.
    acceptance: "exact" (lossless, the default) or an approximate rule (``parse_acceptance``).
    dtype: "bfloat16" or "float32". chat: wrap string prompts in the model's chat template.
    draft_quant: "auto", "none", "int8", "int4": weight-only quantization of a private copy of the
    draft; it cannot change the output, only the speed.
    backend: "auto", "hf" (transformers) or "native" (speculant's own forward: Llama, Mistral, Qwen2/3,
    Phi-3, Gemma 2/3).
    target_quant: "auto", "none", "int8", "int4", "gguf" (native only). "gguf" (a GGUF file or
    preset; "auto" takes it for one): the layers that are Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 or
    Q8_0 in the file run the file's own blocks (``store.gguf_linears``: the file's model), int4 for
    layers of other types. "int4" (auto for other models) quantizes every layer again: smaller
    and faster, and the output is that quantized model's.
    quant_head: quantize the output layer too (None: with the target).
    tree_budget: dynamic trees and lookup: "auto" sizes every step's tree against this machine's
    measured pass cost (at most DEFAULT_MAX_ROWS rows), a ``tuning.costmodel.PassCost`` against a given
    curve, "fixed" always verifies the tree's full size.
    pacing: verify the root alone while drafting does not pay (``tuning.pacing.Pacer``).
    cache_ram: the prefix cache's memory in MiB (``runtime.prefix_cache``: KV entries of earlier
    prompts and answers, reused by any request that starts the same way; native backend only);
    None: the default, ``default_cache_ram()`` (a quarter of this machine's memory, at most 8 GiB);
    0: no prefix cache.
    lora: a peft LoRA adapter directory (e.g. Medusa-2's ``OUT/lora_adapter``) merged into the
    target's weights as it loads, before any quantization (``speculant.store.lora``): the adapted model
    is the one decoded, losslessly. Heads never bring their adapter along; pass it here.

    "auto" values are resolved per machine and model: the runtime by ``defaults.resolve_runtime``
    before the target loads, the rest by ``planning.plan`` once it runs; each returns a config of
    the same type with its choices made (and checked again).
    """

    target: Any
    draft: Any = None
    method: str = "auto"
    gamma: int | None = None
    tree: str | Sequence[Sequence[int]] | None = None
    replacement: bool = True
    dtype: Any = "bfloat16"
    chat: bool = False
    draft_quant: str = "auto"
    heads: Any = None
    acceptance: str | AcceptanceConfig = "exact"
    backend: str = "auto"
    target_quant: str = "auto"
    quant_head: bool | None = None
    lookup_branch: int = 0
    tree_budget: Any = "auto"  # "auto" | "fixed" | costmodel.PassCost
    pacing: bool = True
    lora: Any = None
    cache_ram: int | None = None  # MiB; None: default_cache_ram(); 0: off

    def __post_init__(self) -> None:
        from .tuning.costmodel import PassCost
        from .runtime.quant import QUANT_MODES

        _choice("method", self.method, METHODS)
        _choice("backend", self.backend, BACKENDS)
        if self.target_quant not in ("auto", *QUANT_MODES, "gguf"):
            raise ConfigError(f"unknown target quantization {self.target_quant!r}: choose auto, gguf or one of "
                              f"{', '.join(QUANT_MODES)}")
        if self.draft_quant not in ("auto", *QUANT_MODES):
            raise ConfigError(f"unknown quantization {self.draft_quant!r}: choose one of "
                              f"auto, {', '.join(QUANT_MODES)}")
        if self.target_quant not in ("auto", "none") and self.backend == "hf":
            raise ConfigError("target quantization runs on the native backend: pass backend='native' "
                              "(--backend native)")
        if self.target_quant == "gguf" and self.lora is not None:
            raise ConfigError("target_quant='gguf' runs the GGUF file's own blocks, which do not hold a LoRA adapter's "
                              "changes: leave target_quant on 'auto' (int4 of the adapted weights) or pass 'int4'")
        if not isinstance(self.tree_budget, PassCost) and self.tree_budget not in TREE_BUDGETS:
            raise ConfigError(f"unknown tree budget {self.tree_budget!r}: choose 'auto' (size each step's tree "
                              "against this machine's measured pass cost) or 'fixed' (always the tree's full size)")
        spec = self.spec  # None: "auto", whose choice takes any of these options
        if not _is_int(self.lookup_branch) or self.lookup_branch < 0 or (
                self.lookup_branch and spec is not None and not spec.tree_from_heads):
            *most, last = [repr(m.name) for m in METHOD_TABLE.values() if m.tree_from_heads]
            raise ConfigError(f"lookup_branch={self.lookup_branch}: a prompt-lookup branch of N >= 1 tokens is an "
                              f"option of methods {', '.join(most)} and {last} only (0 = none)")
        if spec is not None and spec.needs_draft and self.draft is None:
            raise ConfigError(f"method {self.method!r} needs a draft model: pass draft=... (--draft SPEC), "
                              "or use --method lookup / ar, which need none")
        if self.gamma is not None and (not _is_int(self.gamma) or not 1 <= self.gamma <= MAX_GAMMA):
            raise ConfigError(f"gamma (draft length) must be between 1 and {MAX_GAMMA}, got {self.gamma}: a pass "
                              f"verifies gamma + 1 rows, and past a few the extra rows cost more than they yield")
        if isinstance(self.tree, list):  # a list of paths: kept as tuples, so the config stays immutable
            object.__setattr__(self, "tree", tuple(tuple(p) for p in self.tree))
        self._check_tree()
        if self.cache_ram is not None and (not _is_int(self.cache_ram) or self.cache_ram < 0):
            raise ConfigError(f"cache_ram is the prefix cache's memory in MiB, an integer >= 0 (0: no prefix cache), "
                              f"got {self.cache_ram!r}")
        object.__setattr__(self, "acceptance", parse_acceptance(self.acceptance))
        if self.lora is not None:
            from .store.lora import check_adapter_dir

            check_adapter_dir(self.lora)  # a directory without a LoRA adapter fails before any model loads

    @property
    def spec(self) -> Method | None:
        """The method's row of :data:`METHOD_TABLE`; None while the method is "auto" (a config
        ``planning.plan`` returns always has one)."""
        return METHOD_TABLE.get(self.method)

    @property
    def dynamic_tree(self) -> bool:
        """Whether ``tree`` asks for a tree grown per step ("dynamic...")."""
        return is_dynamic(self.tree)

    def _check_tree(self) -> None:
        """A bad tree spec fails here, before any model is loaded."""
        if self.tree is None:
            return
        spec = self.spec
        if spec is not None and spec.verifies == "grown" and not self.dynamic_tree:
            raise ConfigError(f"method {self.method!r} grows its tree at every step: use tree='dynamic', 'dynamic:N' "
                              f"or 'dynamic:N:D' (N nodes, depth <= D), not {self.tree!r}")
        if self.dynamic_tree:
            if spec is not None and not spec.tree_from_heads:
                raise ConfigError(f"a dynamic tree ({self.tree!r}) is grown from heads: use --method hydra or "
                                  "medusa, or give a static tree (a k-config or a list of paths)")
            from .trees.dynamic import DynamicTree

            DynamicTree.parse(self.tree)
        else:
            from .trees.buffers import build_tree

            build_tree(self.tree)

    @classmethod
    def from_options(cls, target: Any, draft: Any = None, **options: Any) -> "DecoderConfig":
        """The config of ``SpeculativeDecoder(target, draft, **options)``; an unknown option is a
        ConfigError naming the closest valid one."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("target", "draft")]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown option {key!r}{hint}: the options are {', '.join(names)}")
        return cls(target, draft, **options)


def default_cache_ram() -> int:
    """The prefix cache's default memory in MiB: a quarter of this machine's physical memory, at
    most 8 GiB (llama-server's default ``--cache-ram``)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2048
    return int(min(8192, total // 4 // 2**20))


def _choice(what: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
