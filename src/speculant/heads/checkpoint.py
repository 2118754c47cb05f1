"""Making, saving and loading heads.

Checkpoint layout (the Medusa reference code's parameter names; ``heads.export`` writes the files
other engines load): a directory with

    config.json          {"medusa_num_heads": K, "medusa_num_layers": n,
                          "base_model_name_or_path": ..., "hidden_size": H, "vocab_size": V,
                          "speculant_shared_lm_head": bool}
    model.safetensors    "{k}.{j}.linear.weight" (H, H), "{k}.{j}.linear.bias" (H,)  j < n
                         "{k}.{n}.weight" (V, H)   per-head projection (absent when shared)

``medusa_lm_head.safetensors`` (the name Medusa's own releases use) is read as well.

Sequential heads are saved in the same directory layout with ``"speculant_head_kind":
"sequential"`` (and ``"speculant_draft_vocab"``, ``"speculant_context_size"``) in the config,
which engines that load Medusa heads do not understand. :func:`load_heads` reads both kinds.
A ``tree.json`` next to the weights holds the sparse tree chosen for them (``build-tree``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from .config import HeadsConfig
from .medusa import MedusaHeads
from .projection import check_lm_head, layer_dtype, layer_shape
from .sequential import SequentialHeads

__all__ = ["ALT_WEIGHTS_NAMES", "CONFIG_NAME", "SHIPPED_TREE_NAME", "WEIGHTS_NAME", "heads_tree", "load_heads",
           "floats_in", "make_heads", "save_heads", "shipped_heads", "write_checkpoint"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ALT_WEIGHTS_NAMES = ("medusa_lm_head.safetensors",)


def make_heads(config: HeadsConfig, model: nn.Module) -> "MedusaHeads | SequentialHeads":
    """Fresh heads of ``config`` for ``model`` (a transformers causal LM or NativeModel)."""
    if config.kind == "sequential":
        return SequentialHeads(config, model.get_output_embeddings(), model.get_input_embeddings())
    return MedusaHeads(config, model.get_output_embeddings())



def save_heads(heads: "MedusaHeads | SequentialHeads", path: str | Path) -> Path:
    """Write ``heads`` to the directory ``path`` (created) in the Medusa layout; returns it."""
    return write_checkpoint(Path(path), heads.medusa_state_dict(), heads.config.to_json(), "the heads")


def floats_in(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (a drafter stored as it runs, e.g. a
    float32-trained one in bfloat16: half the file); integer tensors (a draft vocabulary) unchanged."""
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}


def write_checkpoint(out: Path, state: dict[str, torch.Tensor], config: dict, what: str) -> Path:
    """``state`` as WEIGHTS_NAME and ``config`` as CONFIG_NAME in the directory ``out`` (created),
    both complete before either is in place, so a reader never sees half a checkpoint."""
    from safetensors.torch import save_file

    tmp = [out / f".{name}.{os.getpid()}.tmp" for name in (WEIGHTS_NAME, CONFIG_NAME)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp[0]), metadata={"format": "pt"})
        tmp[1].write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp[0], out / WEIGHTS_NAME)
        os.replace(tmp[1], out / CONFIG_NAME)
    except OSError as e:
        raise ConfigError(f"cannot write {what} to {out}: {e.strerror or e}; choose a writable directory with "
                          "free space") from None
    finally:
        for t in tmp:
            t.unlink(missing_ok=True)
    return out


def _read_config(directory: Path) -> dict:
    cfg_file = directory / CONFIG_NAME
    if not cfg_file.is_file():
        raise ModelLoadError(f"{directory} has no {CONFIG_NAME}: a heads checkpoint is a directory with "
                             f"{CONFIG_NAME} and {WEIGHTS_NAME} (written by save_heads / speculant train-heads)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is corrupt (not valid JSON: {e}); re-save or re-download the heads") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object with medusa_num_heads, medusa_num_layers, ...")
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in cfg]
    if missing:
        raise ModelLoadError(f"{cfg_file} lacks {', '.join(missing)}: it is not a Medusa heads config")
    return cfg


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for name in (WEIGHTS_NAME, *ALT_WEIGHTS_NAMES):
        if (directory / name).is_file():
            try:
                return load_file(str(directory / name))
            except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for truncated / bad headers
                raise ModelLoadError(f"{directory / name} is corrupt ({e}); re-save or re-download the heads") from None
    hint = " (a .pt checkpoint: convert it to safetensors first)" if any(directory.glob("*.pt")) else ""
    raise ModelLoadError(f"{directory} has no {WEIGHTS_NAME}{hint}: a heads checkpoint needs its weights "
                         "in safetensors format")


def load_heads(path: str | Path, target_model: nn.Module,
               dtype: torch.dtype | None = None) -> "MedusaHeads | SequentialHeads":
    """Load heads saved by :func:`save_heads` (or Medusa's own layout) for ``target_model`` (a
    transformers causal LM or NativeModel).

    Checks them against the target's output layer (hidden and vocabulary sizes). A checkpoint
    without ``speculant_shared_lm_head`` (e.g. from Medusa) is shared iff it has no projection
    weights; one without ``speculant_head_kind`` holds Medusa heads. ``dtype``: default the target
    output layer's dtype.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"no heads checkpoint at {path}: expected a directory with {CONFIG_NAME} and "
                             f"{WEIGHTS_NAME} (train some with speculant train-heads)")
    raw = _read_config(directory)
    state = _read_weights(directory)
    lm_head = target_model.get_output_embeddings()
    shape = layer_shape(lm_head)
    if shape is None:
        raise ModelLoadError("the target has no output layer with a (V, H) weight to check the heads against")
    V_t, H_t = shape
    K, n = raw["medusa_num_heads"], raw["medusa_num_layers"]
    kind = raw.get("speculant_head_kind", "medusa")
    has_proj = f"0.{n}.weight" in state
    shared = raw.get("speculant_shared_lm_head", not has_proj)
    # sizes the config does not state are read off the tensors (Medusa's own configs omit them)
    block, proj = state.get("0.0.linear.weight"), state.get(f"0.{n}.weight")
    hidden = raw.get("hidden_size") or (block.shape[1] if block is not None and block.dim() == 2 else
                                         proj.shape[1] if proj is not None and proj.dim() == 2 else H_t)
    vocab = raw.get("vocab_size") or (proj.shape[0] if proj is not None and proj.dim() == 2 else V_t)
    try:
        config = HeadsConfig(K, n, hidden, vocab, bool(shared), str(raw.get("base_model_name_or_path") or ""), kind,
                             int(raw.get("speculant_draft_vocab", 0) or 0),
                             int(raw.get("speculant_context_size", 0) or 0))
    except ConfigError as e:
        raise ModelLoadError(f"{directory / CONFIG_NAME} is invalid: {e}") from None
    check_lm_head(lm_head, config)  # hidden / vocabulary mismatch with the target
    with torch.device("meta"):  # no time spent initialising (V, H) projections about to be replaced
        if kind == "sequential":
            heads = SequentialHeads(config, lm_head, target_model.get_input_embeddings())
            module = heads
        else:
            heads = MedusaHeads(config, lm_head if shared else None)
            module = heads.heads
    what = (f"{K} heads x {n} blocks, {'shared' if shared else 'per-head'} projection" if kind == "medusa"
            else f"sequential heads of depth {K}, {n} blocks")
    load_checked(module, state, directory, what)
    if kind == "sequential" and config.draft_vocab:
        try:
            heads.set_draft_vocab(heads.draft_vocab.clone())
        except ConfigError as e:
            raise ModelLoadError(f"{directory}: {e}: the checkpoint is corrupt") from None
    return heads.to(dtype or layer_dtype(lm_head)).eval()


def load_checked(module: nn.Module, state: dict[str, torch.Tensor], directory: Path, what: str) -> None:
    """Load ``state`` into ``module`` (built on the meta device from the checkpoint's config,
    ``what`` in words) after checking that it holds exactly the module's tensors in their shapes."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{directory} does not match its config ({what}): "
            + (f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected tensors {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}" if unexpected else ""))
    for name, t in expected.items():
        if state[name].shape != t.shape:
            raise ModelLoadError(f"tensor {name} in {directory} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(t.shape)} from its config: the checkpoint is corrupt")
    module.load_state_dict(state, assign=True)


SHIPPED_TREE_NAME = "tree.json"  # the default sparse tree shipped next to a heads checkpoint


def shipped_heads(target_name: str, kind: str = "medusa") -> Path | None:
    """The heads directory shipped for a preset target, or None: ``drafters/<preset>`` (Medusa
    heads), ``drafters/<preset>/sequential`` (``kind="sequential"``) or ``drafters/<preset>/eagle``
    (``kind="eagle"``, an EAGLE drafter), installed in the cache by ``make install`` or in a
    checkout's ``data/`` (:mod:`speculant.store.shipped`; the wheel carries no weights)."""
    from ..store.shipped import find_drafter

    return find_drafter(target_name, kind)


def heads_tree(path: str | Path | None) -> str | None:
    """The JSON list of paths stored as ``tree.json`` next to a heads checkpoint (by ``build-tree``), or None."""
    if path is None:
        return None
    f = Path(path) / SHIPPED_TREE_NAME
    return f.read_text() if f.is_file() else None
