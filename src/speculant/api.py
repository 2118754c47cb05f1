"""The public Python API: SpeculativeDecoder.generate / .stream over the decoding loop."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from .backends.hf import HFBackend
from .backends.native import NativeBackend, NativeModel
from .config import AcceptanceConfig, SamplingConfig, parse_acceptance
from .costmodel import PassCost, machine_key, pass_cost
from .decoding import Stats, decode
from .drafters.base import Drafter, NoDrafter
from .drafters.draft_model import DraftModelDrafter
from .drafters.lookup import LookupDrafter
from .drafters.medusa import BlockwiseDrafter, DynamicTree, MedusaDrafter
from .drafters.pacing import Pacer
from .drafters.sizing import TreeSizer
from .defaults import AUTO_LOOKUP_GAMMA, choose_method, choose_runtime
from .heads import MedusaHeads, SequentialHeads, heads_tree, load_heads, shipped_heads
from .errors import ConfigError
from .models import LoadedModel, parse_dtype, chat_prompt, check_vocab_compatible, load, resolve
from .packing import pack_linears
from .quant import QUANT_MODES, quantize_linears
from .sampling import make_generator
from .tree import build_tree, chain

METHODS = ("auto", "ar", "sd", "mcsd", "lookup", "medusa", "hydra", "bpd")
BACKENDS = ("auto", "hf", "native")
NEEDS_DRAFT = {"sd", "mcsd"}
NEEDS_HEADS = {"medusa", "hydra", "bpd"}
TREE_METHODS = {"medusa", "hydra"}  # heads verified as a token tree
# hydra's default: a tree of 15 nodes, depth <= 2, grown per step from the heads' probabilities
# (drafters.medusa.DynamicTree); the static tree shipped next to the heads (tree.json) is still
# there for --tree-file. Depth 2 rather than the heads' 4: at 16 rows with the 8-token lookup chain
# (7 heads' nodes), teacher-forced tau on 52 dev prompts is 2.205 at depth 3, 2.193 at depth 2 and
# 2.025 at depth 1, and each depth drafted costs one head step and one output-layer shortlist
# (~4 ms of a ~190 ms step). (At 29 rows, depth 3 and 4 were alike: 2.341 against 2.342.)
DEFAULT_HYDRA_TREE = "dynamic:15:2"
# A step verifies 1 + DEFAULT_TREE_ROWS rows: with a lookup branch of N tokens merged into hydra's
# default dynamic tree, the heads get DEFAULT_TREE_ROWS - N nodes. With packed bf16 weights
# (packing.py, speculant's kernel) the Qwen 1.5B pass costs 138 / 155 / 172 ms at 1 / 16 / 29 rows
# (500 tokens of context). Teacher-forced tau of hydra+lookup (tools/teacher_forced_tau.py, 52 dev
# prompts) is 2.173 at 16 rows (7 nodes + an 8-token chain) against 2.330 at 29 (16 + 12). Side by
# side on the bench's 12 prompts (bench-results/issue3-tree-ab-s9.*): 16 rows 1.90x over ar at
# tau 2.34, 29 rows 1.79x at tau 2.53. The bench's +lookup methods use N = DEFAULT_LOOKUP_BRANCH.
DEFAULT_TREE_ROWS = 15
# tree_budget="auto" (the default for dynamic trees): every step's tree is sized against the
# measured cost of a pass by rows (costmodel.py, drafters/sizing.py), up to this many rows; the
# fixed sizes above are tree_budget="fixed".
DEFAULT_MAX_ROWS = 32
TREE_BUDGETS = ("auto", "fixed")
# medusa's default with tree_budget="auto": a dynamic tree as deep as the heads go, sized per
# step, DEFAULT_MAX_ROWS - 1 - lookup_branch nodes at most (as hydra's); "fixed" keeps the static tree
# shipped with the heads (tree.json). On the AVX-512 EPYC, same run, 6 prompts, medusa+lookup:
# sized 1.60x over ar (tau 1.89) against 1.11x (tau 2.06) for the static 14-node tree
# (bench-results/issue3-medusa-ab-s10.*), whose 23-row passes cost ~1.5x a one-row pass there.
DEFAULT_MEDUSA_TREE = "dynamic"  # nodes: set from DEFAULT_MAX_ROWS and the lookup branch


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token. source: "draft" (an accepted draft token) or "target"."""
    token_id: int
    text: str  # the new text this token completes (may be "" mid-character)
    source: str


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length"
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


def auto_draft_quant(dtype, backend: str = "hf") -> str:
    """What draft_quant="auto" means for a draft of ``dtype``: "none" unless it is bf16; then on
    the native backend int4, and on the hf backend int4 only where speculant's int4 kernel runs
    (AMX: flat cost to 16 rows), elsewhere the bf16 draft, packed. PyTorch's int4 matmul grows with
    the rows: on the AVX-512 EPYC the 0.5B draft's pass at 1 / 4 / 8 rows took 25.7 / 38.9 / 105.9
    ms in int4 against 28.5 / 34.0 / 43.8 ms packed bf16 (speculant's AVX-512 kernel)."""
    if parse_dtype(dtype) != torch.bfloat16:
        return "none"
    if backend == "native":
        return "int4"
    from .kernels import int4_kernel

    return "int4" if int4_kernel() is not None else "none"


def draft_keeps_dense() -> bool:
    """Whether a quantized native draft keeps its dense bf16 weights too: only with the AMX int4
    kernel, which hands passes of more than 16 rows to the (faster there) bf16 matmul; speculant's
    x86 kernel runs every width itself, so the draft is lean (and saved once, like the target)."""
    from .kernels import int4_kernel

    return int4_kernel() is not None


def _as_model(spec: str | LoadedModel | None, dtype: str, quant: str = "none") -> LoadedModel | None:
    """Load a spec; with ``quant`` != "none", quantize a private copy (a caller's model is never
    modified)."""
    if spec is None:
        return None
    if quant == "auto":
        quant = auto_draft_quant(spec.dtype if isinstance(spec, LoadedModel) else dtype)
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {quant!r}: choose one of {', '.join(QUANT_MODES)}")
    if not isinstance(spec, LoadedModel):
        spec = load(spec, dtype)
    elif quant != "none":
        spec = dataclasses.replace(spec, model=copy.deepcopy(spec.model))
    if quant != "none":
        quantize_linears(spec.model, quant)
    return spec


def load_native(spec: str, dtype: str | torch.dtype = "bfloat16", quant: str = "none",
                quant_head: bool = False, keep_dense: bool = False) -> LoadedModel:
    """Load ``spec`` for the native backend straight from its safetensors directory: no
    transformers model is built, and with ``quant`` each layer is quantized as it is read (its
    dense weight kept only with ``keep_dense``), so the peak memory is about the final model's."""
    from transformers import AutoTokenizer

    dtype = parse_dtype(dtype)
    path = resolve(spec, dtype)
    model = NativeModel.from_dir(path, dtype, quant, quant_head, keep_dense=keep_dense)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    name = str(spec) if "/" not in str(spec) else path.name
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=path, dtype=dtype)


def _native(spec: str | LoadedModel | None, dtype: str, quant: str, quant_head: bool,
            keep_dense: bool) -> LoadedModel | None:
    """A LoadedModel whose ``model`` is a NativeModel: shares a given transformers model's weights
    (its quantized layers keep the dense weight iff ``keep_dense``), or loads ``spec`` lean."""
    if spec is None:
        return None
    if quant == "auto":
        quant = auto_draft_quant(spec.dtype if isinstance(spec, LoadedModel) else dtype, "native")
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {quant!r}: choose one of {', '.join(QUANT_MODES)}")
    if not isinstance(spec, LoadedModel):
        return load_native(spec, dtype, quant, quant_head, keep_dense)
    if isinstance(spec.model, NativeModel):
        if quant != "none" and spec.model.quant != quant:
            raise ConfigError(f"this native model was loaded with quant={spec.model.quant!r}; load it "
                              f"with quant={quant!r} instead (load_native(spec, quant=...))")
        return spec
    model = NativeModel.from_hf(spec.model, quant, quant_head=quant_head and quant != "none", keep_dense=keep_dense)
    return dataclasses.replace(spec, model=model)


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target``, optionally with a ``draft`` model.

    method: "ar" (plain decoding, the baseline), "sd" (draft chain of ``gamma`` tokens),
    "mcsd" (draft token tree, k-config ``tree`` like "4x2x2x1"; candidates sampled with or
    without ``replacement``), "lookup" (n-gram prompt lookup, chain of up to ``gamma`` tokens),
    "medusa" (``heads`` on the target's last hidden state propose a static sparse ``tree``; one
    target call per step), "hydra" (the same with sequential heads, which also read the tokens of
    the path they extend: ``heads.SequentialHeads``), "bpd" (blockwise parallel decoding: the heads'
    top-1 tokens as a chain of ``gamma`` <= K). ``heads``: a heads directory (``save_heads``; for
    medusa/bpd the Medusa checkpoint layout), or the heads object; default: the heads shipped for
    the target preset. lookup_branch: medusa/hydra only, N > 0 adds a prompt-lookup chain of N
    tokens as one more branch of the tree (drafters/medusa.py). ``tree`` for hydra may also be
    "dynamic", "dynamic:N" or "dynamic:N:D" (hydra's default: a tree of N = 15 nodes, depth D <= 2,
    grown at every step from the heads' probabilities, ``drafters.medusa.DynamicTree``; with a lookup branch of
    N' tokens, 15 - N' nodes (at least 4), so a step verifies 16 rows either way; with tree_budget
    "auto" up to DEFAULT_MAX_ROWS rows, sized per step). medusa's default with tree_budget "auto" is
    a dynamic tree sized per step too (DEFAULT_MEDUSA_TREE); with "fixed", the shipped static tree.
    target / draft: a LoadedModel or a spec for ``speculant.load`` (directory, .gguf, preset).
    draft_quant: "auto" (int4 for a bf16 draft where speculant's AMX int4 kernel runs, else none;
    the native backend: int4 for any bf16 draft), "none", "int8" or "int4": weight-only
    quantization of the draft (a private copy).
    It cannot change the output (the target verifies every token), only the speed: the draft's
    cost per pass is bound by the bytes of weights it reads.
    backend: "hf" (transformers runs both models) or "native" (speculant's own Llama / Qwen2
    forward, backends/native.py; shares a given model's weights, or loads a spec lean).
    target_quant: native only, "none", "int8" or "int4": weight-only quantization of the target.
    Unlike the draft's, it changes the output (to the quantized model's; see ``speculant
    quant-eval`` for the cost); the quantized target keeps no dense weight, so every pass of
    every width uses the same quantized weights. quant_head: quantize the output layer too.
    tree_budget: dynamic trees only. "auto" (default): measure what a target pass costs by rows on
    this machine once (cached, ``costmodel.pass_cost``) and size every step's tree to the most
    expected tokens per millisecond (``drafters.sizing.TreeSizer``; at most DEFAULT_MAX_ROWS rows);
    a ``costmodel.PassCost`` does the same with a given curve; "fixed": every step verifies the
    tree's full size (hydra: DEFAULT_TREE_ROWS + 1 rows with a lookup branch; medusa: its static tree).
    """

    def __init__(self, target: str | LoadedModel, draft: str | LoadedModel | None = None, *,
                 method: str = "auto", gamma: int | None = None, tree: str | Sequence[Sequence[int]] | None = None,
                 replacement: bool = True, dtype: str = "bfloat16", chat: bool = False,
                 draft_quant: str = "auto", heads: str | MedusaHeads | SequentialHeads | None = None,
                 acceptance: str | AcceptanceConfig = "exact",
                 backend: str = "auto", target_quant: str = "auto", quant_head: bool | None = None,
                 lookup_branch: int = 0, tree_budget: str | PassCost = "auto", pacing: bool = True):
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if target_quant not in ("auto", *QUANT_MODES):
            raise ConfigError(f"unknown target quantization {target_quant!r}: choose auto or one of {', '.join(QUANT_MODES)}")
        if target_quant not in ("auto", "none") and backend == "hf":
            raise ConfigError("target quantization runs on the native backend: pass backend='native' "
                              "(--backend native)")
        rt = choose_runtime(target, dtype, backend, target_quant, quant_head)
        backend, target_quant, quant_head = rt.backend, rt.target_quant, rt.quant_head
        auto = method == "auto"
        name = target.name if isinstance(target, LoadedModel) else str(target)
        method, lookup_branch, method_why = choose_method(method, name, draft is not None, lookup_branch)
        if gamma is None:
            gamma = AUTO_LOOKUP_GAMMA if auto and method == "lookup" and tree_budget != "fixed" else 4
        self.why = "; ".join(w for w in (rt.why, method_why) if w)  # one plain line: what runs and why
        self.pacing = pacing and method != "ar"
        if lookup_branch < 0 or (lookup_branch and method not in TREE_METHODS):
            raise ConfigError(f"lookup_branch={lookup_branch}: a prompt-lookup branch of N >= 1 tokens is an option "
                              "of methods 'medusa' and 'hydra' only (0 = none)")
        if not isinstance(tree_budget, PassCost) and tree_budget not in TREE_BUDGETS:
            raise ConfigError(f"unknown tree budget {tree_budget!r}: choose 'auto' (size each step's tree against this "
                              "machine's measured pass cost) or 'fixed' (always the tree's full size)")
        if target_quant != "none" and backend != "native":
            raise ConfigError("target quantization runs on the native backend: pass backend='native' "
                              "(--backend native)")
        if method in NEEDS_DRAFT and draft is None:
            raise ConfigError(f"method {method!r} needs a draft model: pass draft=... (--draft SPEC), "
                              "or use --method lookup / ar, which need none")
        if gamma < 1:
            raise ConfigError(f"gamma (draft length) must be >= 1, got {gamma}")
        self.method, self.gamma, self.replacement, self.chat = method, gamma, replacement, chat
        self.lookup_branch = lookup_branch
        self.acceptance = parse_acceptance(acceptance)
        self.dynamic = None
        if isinstance(tree, str) and tree.strip().lower().startswith("dynamic"):
            if method not in TREE_METHODS:
                raise ConfigError(f"a dynamic tree ({tree!r}) is grown from heads: use --method hydra or medusa, "
                                  "or give a static tree (a k-config or a list of paths)")
            self.dynamic, tree = DynamicTree.parse(tree), None
        elif tree is not None:
            build_tree(tree)  # a bad tree spec fails before any model is loaded
        elif method == "hydra" or (method == "medusa" and tree_budget != "fixed"):  # medusa "fixed": its static tree
            self.dynamic = DynamicTree.parse(DEFAULT_HYDRA_TREE if method == "hydra" else DEFAULT_MEDUSA_TREE)
            sized = tree_budget != "fixed"  # the most rows a sized tree may take, else the fixed size
            rows = DEFAULT_MAX_ROWS - 1 if sized else DEFAULT_TREE_ROWS
            if lookup_branch or sized:
                self.dynamic = dataclasses.replace(self.dynamic, nodes=max(rows - lookup_branch, 4))
        self.backend = backend
        if backend == "native":
            self.target = _native(target, dtype, target_quant, quant_head, keep_dense=False)
        else:
            self.target = _as_model(target, dtype)
        kind = "sequential" if method == "hydra" else "medusa"
        if method in NEEDS_HEADS and heads is None:
            heads = shipped_heads(self.target.name, kind)
            if heads is None:
                raise ConfigError(f"method {method!r} needs {kind} heads and none ship for {self.target.name!r}: pass "
                                  "heads=DIR (--heads DIR), a heads directory (train some with `speculant "
                                  f"train-heads --head-kind {kind}`)")
        if tree is None and method in TREE_METHODS:  # the tree built for the heads (tree.json next to them)
            tree = heads_tree(heads) if not isinstance(heads, nn.Module) else None
        self.tree = build_tree(tree or "2x1x1x1") if method in ("mcsd", *TREE_METHODS) else chain(gamma)
        if backend == "native":
            self.draft = _native(draft, dtype, draft_quant, False, keep_dense=draft_keeps_dense()) \
                if method in NEEDS_DRAFT else None
        else:
            self.draft = _as_model(draft, dtype, draft_quant) if method in NEEDS_DRAFT else None
        if self.draft is not None:
            check_vocab_compatible(self.target, self.draft)
        self.tokenizer = self.target.tokenizer
        make = NativeBackend if backend == "native" else HFBackend
        self.target_backend = make(self.target.model, "target")
        self.draft_backend = make(self.draft.model, "draft") if self.draft else None
        self.vocab_size = min(b.vocab_size for b in (self.target_backend, self.draft_backend) if b)
        cfg = self.target.model.config.get_text_config()
        self.max_length = getattr(cfg, "max_position_embeddings", None)
        eos = self.target.model.generation_config.eos_token_id if self.target.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.heads = None
        self.sizer: TreeSizer | None = None  # dynamic trees sized against the pass cost (tree_budget)
        if method in NEEDS_HEADS:
            if isinstance(heads, nn.Module):
                self.heads = heads
            else:  # loaded here, so nobody else holds them: bf16 heads' layers packed like the target's
                self.heads = load_heads(heads, self.target.model)
                pack_linears(self.heads)
            if self.heads.config.kind != kind:
                raise ConfigError(f"method {method!r} needs {kind} heads but these are {self.heads.config.kind} heads: "
                                  f"use --method {'hydra' if self.heads.config.kind == 'sequential' else 'medusa'}"
                                  f"{'' if method != 'bpd' else ' (bpd reads Medusa heads)'}")
            if method in TREE_METHODS and tree is None:  # no tree given or shipped: 3x2x2x1 cut to the heads
                self.tree = build_tree("x".join(map(str, ([3, 2, 2, 1] + [1] * 8)[: self.heads.num_heads])))
            if self.dynamic is not None and tree_budget != "fixed":
                self.sizer = TreeSizer(self._pass_cost(tree_budget, backend, target_quant), max_rows=DEFAULT_MAX_ROWS)
            self._drafter(SamplingConfig(), None)  # fail early: a tree deeper than the heads, gamma > K
            with torch.inference_mode():  # build the int4 drafting shortlist now (~1-4 s), not in a generation
                H = self.heads.config.hidden_size
                if isinstance(self.heads, SequentialHeads):
                    self.heads.draft_topk(torch.zeros(1, H, dtype=self.heads.dtype), 1, self.vocab_size)
                else:
                    self.heads.draft_topk(torch.zeros(H, dtype=self.heads.dtype), 1, 1, self.vocab_size)

        if method == "lookup" and tree_budget != "fixed":
            self.sizer = TreeSizer(self._pass_cost(tree_budget, backend, target_quant), max_rows=DEFAULT_MAX_ROWS)

    def _pass_cost(self, tree_budget, backend: str, target_quant: str) -> PassCost:
        """The given curve, or this machine's measured (and cached) cost of a target pass by rows."""
        if isinstance(tree_budget, PassCost):
            return tree_budget
        runtime = f"{backend}:{target_quant}:{'packed' if backend == 'hf' else 'native'}"
        return pass_cost(self.target_backend, machine_key(self.target.name, self.target.dtype, runtime))

    def encode(self, prompt: str | Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty: give some text to continue")
            text = chat_prompt(self.tokenizer, prompt) if self.chat else prompt
            ids = self.tokenizer(text, add_special_tokens=not self.chat, return_tensors="pt").input_ids[0]
        else:
            ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty: give at least one token")
        return ids

    def _embedding(self) -> torch.Tensor | None:
        """The target's input embeddings (V, H), for the distance acceptance rule only."""
        if self.acceptance.rule != "distance":
            return None
        return self.target.model.get_input_embeddings().weight[: self.vocab_size]

    def _drafter(self, sampling: SamplingConfig, generator) -> Drafter:
        if self.method == "ar":
            return NoDrafter()
        if self.method == "lookup":
            return LookupDrafter(self.gamma, sizer=self.sizer)
        if self.method in TREE_METHODS:
            lookup = LookupDrafter(self.lookup_branch) if self.lookup_branch else None
            return MedusaDrafter(self.heads, self.tree, self.vocab_size, lookup, dynamic=self.dynamic,
                                 sizer=self.sizer)
        if self.method == "bpd":
            return BlockwiseDrafter(self.heads, self.vocab_size, self.gamma)
        return DraftModelDrafter(self.draft_backend, self.tree, sampling, self.vocab_size,
                                 replacement=self.replacement, generator=generator)

    def _run(self, prompt, max_new_tokens, sampling: SamplingConfig):
        ids = self.encode(prompt)
        generator = make_generator(sampling.seed)
        drafter = self._drafter(sampling, generator)
        with torch.inference_mode():
            yield ids, None, None
            for state, step in decode(self.target_backend, drafter, ids, max_new_tokens=max_new_tokens,
                                      sampling=sampling, eos_token_ids=self.eos_token_ids,
                                      max_length=self.max_length, replacement=self.replacement,
                                      generator=generator, vocab_size=self.vocab_size,
                                      acceptance=self.acceptance, embedding=self._embedding(),
                                      pacer=Pacer() if self.pacing else None):
                yield ids, state, step

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and stats."""
        sampling = SamplingConfig(temperature, top_k, top_p, seed)
        state = None
        for ids, state, _ in self._run(prompt, max_new_tokens, sampling):
            pass
        gen = state.generated
        return GenerationResult(self.tokenizer.decode(gen, skip_special_tokens=True), gen,
                                int(ids.shape[0]), state.finish_reason, state.stats)

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None) -> Iterator[TokenEvent]:
        """Yield tokens as they are accepted, each with its text and where it came from."""
        sampling = SamplingConfig(temperature, top_k, top_p, seed)
        gen: list[int] = []
        shown = ""
        self.last_stats, self.last_finish_reason = None, None  # set as the stream runs
        for _, state, step in self._run(prompt, max_new_tokens, sampling):
            if step is None:
                continue
            labelled = [(t, "draft") for t in step.accepted]
            if step.target_token >= 0:
                labelled.append((step.target_token, "target"))
            for tok, source in labelled:
                gen.append(tok)
                text = self.tokenizer.decode(gen, skip_special_tokens=True)
                # hold back an incomplete UTF-8 character until a later token completes it
                piece = text[len(shown):] if not text.endswith("\ufffd") else ""
                shown += piece
                yield TokenEvent(tok, piece, source)
            self.last_stats = state.stats
            self.last_finish_reason = state.finish_reason


def generate(prompt: str, target: str | LoadedModel, draft: str | LoadedModel | None = None, *,
             method: str = "auto", max_new_tokens: int = 128, **kwargs) -> GenerationResult:
    """One-shot convenience: build a decoder and generate."""
    sampling_keys = {"temperature", "top_k", "top_p", "seed"}
    gen_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_keys}
    return SpeculativeDecoder(target, draft, method=method, **kwargs).generate(
        prompt, max_new_tokens, **gen_kwargs)
