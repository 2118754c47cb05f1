"""Saving and loading EAGLE drafters: a directory with

    config.json          {"speculant_eagle": {EagleConfig's fields}}
    model.safetensors    the EAGLE-layout tensors (``fc.*``, ``layers.0.*``; ``draft_vocab`` (V',)
                         int64 with a draft vocabulary)

Both files are written to temporary names first, so a reader never sees half a drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_checked, write_checkpoint
from ..heads.projection import layer_dtype
from .model import EagleConfig, EagleModel

__all__ = ["is_eagle_dir", "load_eagle", "save_eagle"]


def save_eagle(model: EagleModel, path: str | Path) -> Path:
    """Write ``model`` to the directory ``path`` (created); returns it."""
    state = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    return write_checkpoint(Path(path), state, model.config.to_json(), "the EAGLE drafter")


def is_eagle_dir(path) -> bool:
    """Whether ``path`` is a directory holding an EAGLE drafter's config."""
    cfg = Path(path) / CONFIG_NAME if isinstance(path, (str, Path)) else None
    if cfg is None or not cfg.is_file():
        return False
    try:
        return "speculant_eagle" in json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def load_eagle(path: str | Path, target_model: nn.Module, dtype: torch.dtype | None = None) -> EagleModel:
    """The drafter saved at ``path`` by :func:`save_eagle`, for ``target_model`` (a transformers
    causal LM or NativeModel; its output layer and embeddings are shared, checked against the
    drafter's shape). ``dtype``: default the output layer's."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise ModelLoadError(f"no EAGLE drafter at {path}: expected a directory with {CONFIG_NAME} and "
                             f"{WEIGHTS_NAME} (written by speculant's EAGLE training)")
    try:
        config = EagleConfig.from_json(json.loads((directory / CONFIG_NAME).read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{directory / CONFIG_NAME} is corrupt (not valid JSON: {e})") from None
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{directory / CONFIG_NAME} is invalid: {e}") from None
    try:
        state = load_file(str(directory / WEIGHTS_NAME))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for truncated / bad headers
        raise ModelLoadError(f"{directory / WEIGHTS_NAME} is corrupt ({e}); re-save the drafter") from None
    with torch.device("meta"):
        model = EagleModel(config, target_model.get_output_embeddings(), target_model.get_input_embeddings())
    load_checked(model, state, directory, f"an EAGLE drafter of hidden size {config.hidden_size}")
    model.inv_freq = config.rope_frequencies()  # not saved: made again, off the meta device
    if config.draft_vocab:
        try:
            model.set_draft_vocab(model.draft_vocab.clone())
        except ConfigError as e:
            raise ModelLoadError(f"{directory}: {e}: the drafter is corrupt") from None
    return model.to(dtype or layer_dtype(target_model.get_output_embeddings())).eval()
