"""What runs when the user names only a model: the fastest lossless setup of this CPU.

runtime   models of the native runtime's families (``backends.native_arch``) in bf16 run on it with
          int4 weights (the output layer too) wherever speculant's int4 kernel runs (every x86-64 CPU with a C++
          compiler: its AMX, AVX-512 VNNI, AVX2 or portable path); its passes are row-invariant, so
          speculative output equals plain output bit for bit. Other architectures (and float32)
          run on transformers.
method    with heads shipped for the target: ``hydra`` with an 8-token prompt-lookup branch, its tree
          sized at every step against this machine's measured pass cost; with a draft model:
          ``sd``; otherwise prompt ``lookup``, its chain sized the same way. Every drafting method
          runs under a :class:`drafters.pacing.Pacer`, which verifies the root alone (plain
          decoding, no drafting) while drafting does not pay on the text at hand. When an EAGLE
          drafter ships beside the heads (with held-out accuracies for both), the decoder takes
          ``eagle`` instead where the cost model forecasts it faster on this CPU
          (:func:`choose_shipped_drafter`, once the target runs: ``drafters.choice``).

:func:`resolve` turns a ``DecoderConfig``'s "auto" values into these choices. Why each default is
what it is: docs/design-notes.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .config import DEFAULT_LOOKUP_BRANCH, DecoderConfig
from .backends.native_arch import SUPPORTED, native_refusal
from .costmodel import PassCost

__all__ = ["Runtime", "choose_method", "choose_runtime", "choose_shipped_drafter", "resolve"]

AUTO_LOOKUP_BRANCH = DEFAULT_LOOKUP_BRANCH  # hydra+lookup's chain
AUTO_LOOKUP_GAMMA = 8  # lookup's longest chain when sized per step
DEFAULT_GAMMA = 4  # sd's chain, bpd's and a fixed lookup chain's length


@dataclass(frozen=True)
class Runtime:
    backend: str  # "hf" | "native"
    target_quant: str  # "none" | "int8" | "int4"
    quant_head: bool
    why: str  # one plain sentence


def _config(target) -> dict:
    """The model config (as a dict) of a spec or LoadedModel, without loading weights; {} if unknown."""
    from .models import LoadedModel, resolve

    if isinstance(target, LoadedModel):
        cfg = target.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    try:
        path = resolve(target, torch.bfloat16)
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def int4_fits(cfg: dict) -> bool:
    """Whether every linear layer of a model with config ``cfg`` takes speculant's int4 layout
    (inputs in groups of 64, outputs in blocks of 16)."""
    H, F = cfg.get("hidden_size", 0), cfg.get("intermediate_size", 0)
    heads = cfg.get("num_attention_heads", 0) or 1
    D = cfg.get("head_dim") or H // heads
    kv = cfg.get("num_key_value_heads") or heads
    return bool(H and F) and H % 64 == 0 and F % 64 == 0 and (heads * D) % 64 == 0 and (kv * D) % 16 == 0


def int4_kernel_name() -> str | None:
    """Which code path of speculant's int4 kernel runs here ("AVX-512 VNNI", "AVX2", ...), or None."""
    from .kernels import int4_isa

    isa = int4_isa()
    return None if isa is None else {"amx": "AMX + AVX-512 VNNI", "avx512-vnni": "AVX-512 VNNI",
                                     "avx2-vnni": "AVX2 + AVX-VNNI", "avx2": "AVX2", "portable": "portable C++"}[isa]


def choose_runtime(target, dtype, backend: str = "auto", target_quant: str = "auto",
                   quant_head: bool | None = None) -> Runtime:
    """Resolve "auto" backend / target quantization / output-layer quantization for ``target``."""
    from .models import LoadedModel, parse_dtype

    dtype = target.dtype if isinstance(target, LoadedModel) else parse_dtype(dtype)  # a loaded model's own
    cfg = _config(target) if backend == "auto" or target_quant == "auto" else {}
    arch = cfg.get("model_type")
    kernel = int4_kernel_name()
    why = ""
    if backend == "auto":
        refusal = native_refusal(cfg) if arch in SUPPORTED else None
        if arch not in SUPPORTED:
            backend, why = "hf", (f"transformers runs {arch or 'this model'} (speculant's native runtime covers "
                                  f"{', '.join(SUPPORTED)} models)")
        elif refusal:
            backend, why = "hf", f"transformers runs it ({refusal})"
        elif dtype != torch.bfloat16 or kernel is None or not int4_fits(cfg):
            backend = "hf"
            why = ("transformers runs it in float32 (the native int4 runtime needs bfloat16)" if dtype != torch.bfloat16
                   else "transformers runs it (no C++ compiler for speculant's int4 kernel here)" if kernel is None
                   else "transformers runs it (its layer sizes do not fit the int4 layout: multiples of 64)")
        else:
            backend = "native"
    if target_quant == "auto":
        fits = int4_fits(cfg) if cfg else True
        target_quant = "int4" if backend == "native" and dtype == torch.bfloat16 and kernel is not None and fits \
            else "none"
    if quant_head is None:
        quant_head = target_quant != "none"
    if backend == "native" and not why:
        what = f"int4 weights ({kernel} kernel)" if target_quant == "int4" else f"{target_quant} weights" \
            if target_quant != "none" else str(dtype).removeprefix("torch.") + " weights"
        why = f"speculant's native runtime, {what}{', output layer included' if quant_head and target_quant != 'none' else ''}"
    return Runtime(backend, target_quant, bool(quant_head), why)


def _heads_why(method: str, lookup_branch: int) -> str:
    """What "auto" says of a heads method it took."""
    what = {"hydra": "the heads", "eagle": "the EAGLE drafter"}[method]
    lookup = " plus prompt lookup" if lookup_branch else ""
    return (f"{method}{'+lookup' if lookup_branch else ''} ({what} shipped for this model{lookup}; each step's tree "
            "sized against this CPU's measured pass cost, drafting paused while it does not pay)")


def choose_method(method: str, target_name: str, has_draft: bool, lookup_branch: int) -> tuple[str, int, str]:
    """(method, lookup_branch, why) for ``method`` "auto" (anything else passes through)."""
    from .heads import shipped_heads

    if method != "auto":
        return method, lookup_branch, ""
    if has_draft:
        return "sd", 0, "sd with the given draft model, drafting paused while it does not pay"
    if shipped_heads(target_name, "sequential") is not None:
        lookup_branch = lookup_branch or AUTO_LOOKUP_BRANCH
        return "hydra", lookup_branch, _heads_why("hydra", lookup_branch)
    return "lookup", 0, ("prompt lookup (no heads ship for this model; the chain sized against this CPU's measured "
                         "pass cost, drafting paused while it does not pay)")


def resolve(config: DecoderConfig) -> tuple[DecoderConfig, str]:
    """``config`` with every "auto" choice made for this machine and model (backend, target
    quantization, output-layer quantization, method, lookup branch, gamma), checked again as a
    whole; and one plain line saying what runs and why ("" when nothing was chosen)."""
    rt = choose_runtime(config.target, config.dtype, config.backend, config.target_quant, config.quant_head)
    name = getattr(config.target, "name", None) or str(config.target)
    method, lookup_branch, method_why = choose_method(config.method, name, config.draft is not None,
                                                      config.lookup_branch)
    gamma = config.gamma
    if gamma is None:
        sized_lookup = config.method == "auto" and method == "lookup" and config.tree_budget != "fixed"
        gamma = AUTO_LOOKUP_GAMMA if sized_lookup else DEFAULT_GAMMA
    resolved = dataclasses.replace(config, method=method, lookup_branch=lookup_branch, gamma=gamma,
                                   backend=rt.backend, target_quant=rt.target_quant, quant_head=rt.quant_head)
    return resolved, "; ".join(w for w in (rt.why, method_why) if w)


def choose_shipped_drafter(config: DecoderConfig, why: str, target, backend, price: Callable[[], PassCost],
                           ) -> tuple[DecoderConfig, str, torch.nn.Module | None, PassCost | None]:
    """For a resolved "auto" that took ``hydra`` (its heads ship for the target): where an EAGLE
    drafter ships too, with held-out accuracies for both (``drafters.choice``), the method the cost
    model forecasts faster on this machine. ``target``: the LoadedModel; ``backend``: its Backend;
    ``price()``: its PassCost, asked for only when there is a choice to make. Returns (config, why,
    the chosen drafter loaded, the PassCost), the last two None when nothing was compared."""
    from .config import SamplingConfig
    from .drafters.choice import CacheSweep, Forecast, choose_drafter, held_out_accepts, time_drafting
    from .drafters.factory import DraftParts, build_drafter, plan_tree, warm_up_heads
    from .heads import shipped_heads
    from .loading import load_decoder_heads

    eagle = shipped_heads(target.name, "eagle")
    if config.method != "hydra" or config.heads is not None or eagle is None or not (
            config.tree is None or config.dynamic_tree):
        return config, why, None, None
    accepts = held_out_accepts(eagle)
    sources = {"hydra": shipped_heads(target.name, "sequential"), "eagle": eagle}
    if any(m not in accepts or sources[m] is None for m in sources):
        return config, why, None, None
    V = backend.vocab_size
    prompt = torch.arange(64, dtype=torch.long) % V  # any tokens: only the drafting time is read
    hidden = target.model.get_input_embeddings().weight[prompt[:-1]].detach()  # (T-1, H), a plausible scale
    forecasts, loaded, sweep = [], {}, CacheSweep()  # one buffer for every drafter's timing
    for method, source in sources.items():
        heads = load_decoder_heads(source, target.model, method)
        tree, dynamic = plan_tree(dataclasses.replace(config, method=method), source, heads.num_heads)
        warm_up_heads(heads, V)
        timing = dataclasses.replace(config, method=method, lookup_branch=0)  # the chain costs both the same
        drafter = build_drafter(timing, DraftParts(tree, V, dynamic, heads=heads), SamplingConfig())
        table = tuple(row[:dynamic.nodes] for row in accepts[method])  # the nodes the lookup chain leaves
        forecasts.append(Forecast(method, table, time_drafting(drafter, prompt, hidden, sweep=sweep)))
        loaded[method] = heads
    cost = price()
    chosen, reason = choose_drafter(forecasts, cost)
    if chosen.method != config.method:
        why = why.replace(_heads_why(config.method, config.lookup_branch),
                          _heads_why(chosen.method, config.lookup_branch))
        config = dataclasses.replace(config, method=chosen.method)
    return config, f"{why}; {reason}", loaded[chosen.method], cost
