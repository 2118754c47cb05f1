"""A peft LoRA adapter merged into the target's weights when the target is loaded (``lora=DIR``,
``--lora DIR``).

Medusa-2 training (``speculant train-heads --mode medusa2``) adapts the backbone with LoRA and
writes the adapter to ``OUT/lora_adapter``: the Medusa-2 model is that adapted backbone plus the
heads in ``OUT``. With ``lora=OUT/lora_adapter`` the adapter is merged by peft itself
(``PeftModel.from_pretrained(...).merge_and_unload()``) into the freshly loaded transformers
model, in its load dtype, before anything else sees it: before the native runtime reads its
weights and quantizes them. The decoded model IS the adapted model, and every method verifies
against it, so decoding is lossless with respect to it.

The adapter is checked before peft sees it: peft silently skips adapter weights for modules the
model lacks (an adapter for a deeper model loads into a shallower one), so every module the
adapter's weights name must exist in the target as a linear layer of the adapter's shape.

A heads directory never brings its adapter along: the adapter changes the model being decoded,
so it is applied only when asked for (``adapter_note`` says so when the heads came with one).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError, ModelLoadError

__all__ = ["ADAPTER_DIR", "adapter_note", "check_adapter_dir", "merge_lora"]

ADAPTER_DIR = "lora_adapter"  # where train-heads --mode medusa2 writes the adapter, inside its OUT
_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."  # peft's prefix of every saved adapter weight


def check_adapter_dir(adapter: Any) -> dict:
    """The adapter configuration of the LoRA adapter directory ``adapter`` (``adapter_config.json``);
    a ConfigError naming the directory and what is missing, without loading any model."""
    if not isinstance(adapter, (str, os.PathLike)):
        raise ConfigError(f"lora must be a LoRA adapter directory (a path), got {type(adapter).__name__}")
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise ConfigError(f"lora adapter {adapter}: no such directory; pass the adapter directory a peft model "
                          f"saved (`train-heads --mode medusa2` writes OUT/{ADAPTER_DIR})")
    if not (path / _CONFIG).is_file():
        inside = path / ADAPTER_DIR / _CONFIG
        hint = (f"; this looks like a Medusa-2 output directory: pass {path / ADAPTER_DIR}" if inside.is_file()
                else f" (`train-heads --mode medusa2` writes one to OUT/{ADAPTER_DIR})")
        raise ConfigError(f"lora adapter {adapter}: no peft adapter there (it has no {_CONFIG}){hint}")
    try:
        config = json.loads((path / _CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"lora adapter {adapter}: cannot read {_CONFIG}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError(f"lora adapter {adapter}: {_CONFIG} describes a {kind or 'non-peft'} adapter; only LoRA "
                          "adapters (peft_type LORA) can be merged into the target")
    if not any((path / name).is_file() for name in _WEIGHTS):
        raise ConfigError(f"lora adapter {adapter}: no adapter weights ({' or '.join(_WEIGHTS)}); save the adapter "
                          "again with peft's save_pretrained")
    return config


def _adapter_weights(path: Path) -> dict:
    """The adapter's saved tensors by name (as peft saved them)."""
    try:
        if (path / _WEIGHTS[0]).is_file():
            from safetensors.torch import load_file

            return load_file(str(path / _WEIGHTS[0]))
        import torch

        return torch.load(path / _WEIGHTS[1], map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise ModelLoadError(f"lora adapter {path}: its weights cannot be read ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); save the adapter again") from None


def _check_fits(model: nn.Module, path: Path, config: dict, weights: dict) -> None:
    """Every module the adapter adapts exists in ``model`` as a linear layer of the adapter's shape,
    and the adapter was made for the model's class (when it recorded one)."""
    made_for = (config.get("auto_mapping") or {}).get("base_model_class")
    base = config.get("base_model_name_or_path")
    source = (f" (made for {made_for}{f' {base}' if base else ''})" if made_for
              else (f" (made for {base})" if base else ""))
    if made_for and made_for != type(model).__name__:
        raise ModelLoadError(f"lora adapter {path} was made for a {made_for}, the target is a {type(model).__name__}: "
                             "pass the adapter trained for this target")
    modules = dict(model.named_modules())
    for key, tensor in weights.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue  # other saved tensors (modules_to_save, DoRA magnitudes): peft checks them
        name = key.removeprefix(_PREFIX).split(".lora_")[0]
        layer = modules.get(name)
        if layer is None:
            raise ModelLoadError(f"lora adapter {path}{source} adapts {name}, which the target does not have: it "
                                 "was trained for another model; pass the adapter trained for this target")
        if not isinstance(layer, nn.Linear):
            raise ModelLoadError(f"lora adapter {path} adapts {name}, a {type(layer).__name__} in the target; only "
                                 "adapters on linear layers can be merged")
        if ".lora_A." in key and tensor.shape[-1] != layer.in_features:
            raise ModelLoadError(f"lora adapter {path}{source} does not fit the target: {name} takes "
                                 f"{layer.in_features} inputs, the adapter's {tensor.shape[-1]}: it was trained for a "
                                 "model of another size; pass the adapter trained for this target")
        if ".lora_B." in key and tensor.shape[0] != layer.out_features:
            raise ModelLoadError(f"lora adapter {path}{source} does not fit the target: {name} gives "
                                 f"{layer.out_features} outputs, the adapter's {tensor.shape[0]}: it was trained for a "
                                 "model of another size; pass the adapter trained for this target")


def merge_lora(model: nn.Module, adapter: str | os.PathLike) -> nn.Module:
    """``model`` (a transformers causal LM, modified in place) with the LoRA adapter directory
    ``adapter`` merged into its weights by peft; returned in eval mode without gradients. A
    directory that holds no LoRA adapter is a ConfigError, an adapter that does not fit the model
    a ModelLoadError, each naming the directory and what is wrong."""
    config = check_adapter_dir(adapter)
    path = Path(adapter).expanduser()
    _check_fits(model, path, config, _adapter_weights(path))
    from peft import PeftModel

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on adapter dtypes and deprecations
            merged = PeftModel.from_pretrained(model, str(path), is_trainable=False).merge_and_unload()
    except Exception as e:  # noqa: BLE001 - whatever peft refuses, as one line naming the directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"lora adapter {path}: peft could not merge it into the target ({type(e).__name__}: "
                             f"{first}); pass the adapter trained for this target") from None
    merged.eval()
    merged.requires_grad_(False)
    return merged


def adapter_note(heads: Any, lora: Any) -> str | None:
    """A note when heads come from a Medusa-2 output directory (an adapter beside them) but no
    adapter is merged: those heads are then used with the original target. None otherwise."""
    if lora is not None or not isinstance(heads, (str, os.PathLike)):
        return None
    inside = Path(heads).expanduser() / ADAPTER_DIR
    if not (inside / _CONFIG).is_file():
        return None
    return (f"the heads in {heads} come with a LoRA adapter ({inside}, Medusa-2) that is not applied: decoding the "
            f"original target with them (lossless, fewer accepted drafts); pass --lora {inside} (lora=...) to decode "
            "the adapted model they were trained with")
