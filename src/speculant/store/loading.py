"""Loading what a decoder runs: the target and draft models on the chosen runtime, quantized as
configured, and the drafting heads.

The hf runtime keeps a transformers model (``store.models.load``); the native runtime a
:class:`~speculant.backends.native.NativeModel`, built straight from a safetensors directory or
sharing a given transformers model's weights. A caller's model is never modified: quantizing one
works on a private copy.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ..backends.native import NativeModel
from ..config import METHOD_TABLE, DecoderConfig, method_reading
from ..errors import ConfigError
from ..heads import MedusaHeads, SequentialHeads, load_heads, shipped_heads
from ..heads.projection import check_lm_head
from .models import LoadedModel, load, parse_dtype, resolve
from ..runtime.packing import pack_linears, unpack_linears
from ..runtime.quant import QUANT_MODES, quantize_linears

__all__ = ["auto_draft_quant", "find_heads", "load_adapted", "load_decoder_heads", "load_draft", "load_native",
           "load_target", "shipped_drafter"]

EAGLE = "eagle"  # Method.heads of an EAGLE drafter: a model of its own, loaded by eagle.checkpoint, not as heads


def auto_draft_quant(dtype, backend: str = "hf") -> str:
    """What draft_quant="auto" means for a draft of ``dtype``: "none" unless it is bf16; then on
    the native backend int4, and on the hf backend int4 only on AMX CPUs (where the int4
    kernel's cost grows least with the rows), elsewhere the bf16 draft, packed: PyTorch's int4 matmul grows
    with the rows. Why: docs/design-notes.md#draft-quantization"""
    if parse_dtype(dtype) != torch.bfloat16:
        return "none"
    if backend == "native":
        return "int4"
    from ..kernels import int4_isa

    return "int4" if int4_isa() == "amx" else "none"


def _quant_mode(quant: str, spec: str | LoadedModel, dtype, backend: str) -> str:
    """``quant`` with "auto" resolved for the model ``spec``; an unknown mode is a ConfigError."""
    if quant == "auto":
        quant = auto_draft_quant(spec.dtype if isinstance(spec, LoadedModel) else dtype, backend)
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {quant!r}: choose one of {', '.join(QUANT_MODES)}")
    return quant


def load_hf(spec: str | LoadedModel, dtype, quant: str = "none") -> LoadedModel:
    """A transformers model for the hf runtime; with ``quant`` != "none" its linear layers are
    quantized (weight-only), on a private copy of a given model."""
    quant = _quant_mode(quant, spec, dtype, "hf")
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
    dense weight kept only with ``keep_dense``), so the peak memory is about the final model's.
    ``quant`` "gguf": as in :func:`to_native`."""
    if quant == "gguf":
        return _with_gguf_blocks(spec, dtype, quant_head)
    dtype = parse_dtype(dtype)
    path = resolve(spec, dtype)
    return _loaded(spec, path, dtype, NativeModel.from_dir(path, dtype, quant, quant_head, keep_dense=keep_dense))


def _loaded(spec: str, path, dtype: torch.dtype, model: NativeModel) -> LoadedModel:
    """The LoadedModel of ``model``, read from ``path`` (``spec`` resolved), with its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    name = str(spec) if "/" not in str(spec) else path.name
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=path, dtype=dtype)


def to_native(spec: str | LoadedModel, dtype, quant: str, quant_head: bool, keep_dense: bool) -> LoadedModel:
    """A LoadedModel whose ``model`` is a NativeModel: shares a given transformers model's weights
    (its quantized layers keep the dense weight iff ``keep_dense``), or loads ``spec`` lean.
    ``quant`` "gguf": int4, then the layers of a type in ``gguf_linears.RUNS`` in the GGUF file behind ``spec`` run the
    file's own blocks (``store.gguf_linears``)."""
    if quant == "gguf":
        return _with_gguf_blocks(spec, dtype, quant_head)
    quant = _quant_mode(quant, spec, dtype, "native")
    if not isinstance(spec, LoadedModel):
        return load_native(spec, dtype, quant, quant_head, keep_dense)
    if isinstance(spec.model, NativeModel):
        if quant != "none" and spec.model.quant != quant:
            raise ConfigError(f"this native model was loaded with quant={spec.model.quant!r}; load it "
                              f"with quant={quant!r} instead (load_native(spec, quant=...))")
        return spec
    model = NativeModel.from_hf(spec.model, quant, quant_head=quant_head and quant != "none", keep_dense=keep_dense)
    return dataclasses.replace(spec, model=model)


def _with_gguf_blocks(spec: str | LoadedModel, dtype, quant_head: bool) -> LoadedModel:
    """``to_native``'s "gguf": the int4 native model of ``spec`` with its layers of the types
    ``gguf_linears.RUNS`` (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) the file's. Loaded from
    its files, the result is saved once per machine and read back after that
    (``backends.native_gguf_store``); a given transformers model (its weights perhaps not the
    files', e.g. with a LoRA adapter merged) is built on every call."""
    from .gguf_linears import RUNS, source_gguf

    source = source_gguf(spec.path if isinstance(spec, LoadedModel) else spec)  # before anything loads
    if isinstance(spec, LoadedModel) and isinstance(spec.model, NativeModel):
        if spec.model.quant != "gguf":
            raise ConfigError(f"this native model was loaded with quant={spec.model.quant!r}; load it with "
                              "quant='int4' and let the decoder apply the file's blocks (target_quant='gguf')")
        return spec
    if isinstance(spec, LoadedModel):
        loaded, report, saved = *_apply_gguf_blocks(spec, dtype, quant_head, source), None
    else:
        loaded, report, saved = _saved_gguf_blocks(spec, dtype, quant_head, source)
    kept = ", ".join(f"{n} {t}" for t, n in sorted(report["kept"].items()))
    replaced = {t: report[t.lower()] for t in RUNS if report[t.lower()]}
    types = ", ".join(f"{n} {t}" for t, n in replaced.items())
    print(f"speculant: {sum(replaced.values())} layers run {source.name}'s own blocks ({types or 'none'})"
          + (f"; int4 for the rest ({kept} in the file)" if kept else "")
          + (f"; read from the saved copy {saved}" if saved else ""), file=sys.stderr, flush=True)
    return loaded


def _apply_gguf_blocks(spec: str | LoadedModel, dtype, quant_head: bool, source) -> tuple[LoadedModel, dict]:
    """The int4 native model of ``spec`` with the layers of ``source``'s blocks, and
    ``apply_gguf_blocks``' report."""
    from .gguf_linears import apply_gguf_blocks

    loaded = to_native(spec, dtype, "int4", quant_head, keep_dense=False)
    model = loaded.model  # a NativeModel of its own (the blocks are replaced in it, not in spec's)
    report = apply_gguf_blocks(model, source)
    model.quant = "gguf"
    return dataclasses.replace(loaded, model=model), report


def _saved_gguf_blocks(spec: str, dtype, quant_head: bool, source) -> tuple[LoadedModel, dict, Path | None]:
    """:func:`_apply_gguf_blocks` of a spec, read from its saved copy where there is one (then
    also that file's path; else None), else built and saved (as the int4 model is saved by
    ``NativeModel.from_dir``, under the same conditions: speculant's int4 kernel runs here)."""
    from ..backends.native_gguf_store import gguf_store_path, load_gguf_store, save_gguf_store, storable
    from ..backends.native_model import int4_layout, read_dir_config
    from ..backends.native_store import remove_partial_saves
    from ..kernels import GROUP
    from ..runtime.process import file_lock

    dtype = parse_dtype(dtype)
    kind = int4_layout(GROUP) if dtype == torch.bfloat16 else None
    if kind is None:  # no int4 model to save: loading it says why
        return *_apply_gguf_blocks(spec, dtype, quant_head, source), None
    path = resolve(spec, dtype)
    cfg, gen, files = read_dir_config(path)
    store = gguf_store_path(path, [path / f for f in files], source, quant_head, kind, GROUP)
    found = load_gguf_store(store, cfg, gen, dtype)
    if found is None:
        with file_lock(store.with_name(store.name + ".lock")):
            found = load_gguf_store(store, cfg, gen, dtype, quiet=True)  # made by another process meanwhile?
            if found is None:
                remove_partial_saves(store, "gguf-block model")
                print(f"speculant: reading {source.name}'s own blocks once for this machine; saved to {store}",
                      file=sys.stderr, flush=True)
                loaded, report = _apply_gguf_blocks(spec, dtype, quant_head, source)
                if storable(loaded.model):
                    try:
                        save_gguf_store(loaded.model, store, kind, GROUP, quant_head, report)
                    except OSError as e:
                        print(f"speculant: could not save the gguf-block model ({e}); its blocks will be read "
                              "again next time", file=sys.stderr, flush=True)
                else:
                    print("speculant: not saved: some layers are neither int4 of speculant's layout nor the file's "
                          "blocks", file=sys.stderr, flush=True)
                return loaded, report, None
    model, report = found
    return _loaded(spec, path, dtype, model), report, store


def load_adapted(spec: str | LoadedModel, dtype, lora: str | os.PathLike) -> LoadedModel:
    """The transformers model ``spec`` with the LoRA adapter directory ``lora`` merged into its
    weights by peft (``store.lora.merge_lora``; on a private copy of a given model), in ``dtype``."""
    from .lora import check_adapter_dir, merge_lora

    check_adapter_dir(lora)  # a bad directory fails before the model loads
    if isinstance(spec, LoadedModel):
        if isinstance(spec.model, NativeModel):
            raise ConfigError("lora: a LoRA adapter is merged into a transformers model, and this target is already "
                              "a native model; pass the target's spec (or a transformers LoadedModel) instead")
        spec = dataclasses.replace(spec, model=copy.deepcopy(spec.model))
        unpack_linears(spec.model)  # peft adapts nn.Linear layers (a decoder's HFBackend packs them)
    else:
        spec = load(spec, dtype)
    return dataclasses.replace(spec, model=merge_lora(spec.model, lora))


def load_target(config: DecoderConfig) -> LoadedModel:
    """The target on the config's (resolved) runtime, quantized as ``target_quant`` says; with
    ``lora``, the adapter is merged first, so the native runtime reads (and quantizes) the
    adapted weights."""
    target = config.target
    if config.lora is not None:
        target = load_adapted(target, config.dtype, config.lora)
    if config.backend == "native":
        return to_native(target, config.dtype, config.target_quant, config.quant_head, keep_dense=False)
    return load_hf(target, config.dtype)


def load_draft(config: DecoderConfig) -> LoadedModel | None:
    """The draft model of a draft-model method (None otherwise), quantized as ``draft_quant`` says."""
    if not config.spec.needs_draft:
        return None
    if config.backend == "native":
        return to_native(config.draft, config.dtype, config.draft_quant, False, keep_dense=False)
    return load_hf(config.draft, config.dtype, config.draft_quant)


def shipped_drafter(target_name: str, method: str) -> Path | None:
    """The drafter shipped for ``target_name`` of the kind ``method`` reads (its row's
    ``Method.heads``: Medusa or sequential heads, an EAGLE drafter), or None (none ships, or the
    method reads none). The one way the shipped heads and drafters are looked up."""
    kind = METHOD_TABLE[method].heads
    return shipped_heads(target_name, kind) if kind is not None else None


def find_heads(config: DecoderConfig, target_name: str):
    """Where a heads method's heads come from: the config's directory or module, else the heads
    shipped for ``target_name`` (None for methods without heads)."""
    spec = config.spec
    if spec.heads is None:
        return None
    if config.heads is not None:
        return config.heads
    found = shipped_drafter(target_name, config.method)
    if found is None:
        raise ConfigError(f"method {config.method!r} needs " + spec.missing_heads.format(target=target_name))
    return found


def int4_heads(heads: nn.Module, always: bool = False) -> bool:
    """On a CPU without a fast bf16 matmul (no AVX-512 / AVX-NE-CONVERT bf16: oneDNN's packed bf16
    linear does not run, PyTorch's costs ~1 ms per row and layer) bf16 heads' linear layers become
    int4 through speculant's x86 kernel, in place (8-15x faster per call at 1-16 rows). Drafts
    only: the target verifies every token, so the output is the same. Returns whether it did.
    ``heads``: Medusa or sequential heads or an EAGLE drafter (each says its ``dtype``).
    ``always``: on every CPU the kernel runs on (a drafter too big to be cheap in bf16 even packed:
    a drafting step reads all its weights for a handful of rows). Why: docs/design-notes.md#int4-heads-on-avx2"""
    from ..kernels import GROUP, x86_kernels
    from ..runtime.packing import available, swap_modules
    from ..runtime.quant import Int4Linear

    if (available() and not always) or x86_kernels() is None or heads.dtype != torch.bfloat16:
        return False
    return swap_modules(heads, nn.Linear, lambda linear: Int4Linear(linear, keep_dense=False),
                        want=lambda linear: linear.in_features % GROUP == 0 and linear.out_features % 16 == 0) > 0


def load_decoder_heads(source, target_model: nn.Module, method: str) -> MedusaHeads | SequentialHeads:
    """The heads from ``source`` (a module is used as given; a directory is loaded here, so nobody
    else holds them, and bf16 heads' layers are packed like the target's), checked to be the kind
    ``method`` reads."""
    from ..eagle import EagleModel
    from ..eagle.checkpoint import is_eagle_dir, load_eagle

    want = METHOD_TABLE[method].heads
    if isinstance(source, EagleModel) or (not isinstance(source, nn.Module) and is_eagle_dir(source)):
        if want != EAGLE:
            raise ConfigError(f"{source if not isinstance(source, nn.Module) else 'these heads'} is an EAGLE "
                              f"drafter: use --method {method_reading(EAGLE)}")
        if isinstance(source, EagleModel):
            return source
        drafter = load_eagle(source, target_model)
        # int4 wherever speculant's kernel runs: ~33M weights read for a handful of rows per depth
        # (Why: docs/design-notes.md#eagle-drafter-in-int4)
        if int4_heads(drafter, always=True):
            from ..runtime.quant import joined

            drafter.fuse_projections(joined)  # q/k/v and gate/up: one int4 call each, the same bits
        else:
            pack_linears(drafter)
        return drafter
    if want == EAGLE:
        raise ConfigError(f"method {method!r} needs an EAGLE drafter; {source} holds heads (use --method "
                          "hydra or medusa for them)")
    if isinstance(source, nn.Module):
        heads = source
        check_lm_head(target_model.get_output_embeddings(), heads.config)  # heads made for this target?
    else:
        heads = load_heads(source, target_model)
        if not int4_heads(heads):
            pack_linears(heads)
    have = heads.config.kind
    if have != want:
        # a method reading heads of another method's kind says so (bpd reads Medusa heads)
        note = "" if method == method_reading(want) else f" ({method} reads {want.capitalize()} heads)"
        raise ConfigError(f"method {method!r} needs {want} heads but these are {have} heads: "
                          f"use --method {method_reading(have)}{note}")
    return heads
