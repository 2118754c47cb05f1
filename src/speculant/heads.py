"""Medusa / blockwise-parallel heads on the target's final (normed) hidden state.

Notation: H = hidden size, V = vocabulary size, K = number of heads. For the hidden state
``h_t`` of position t (the one whose output layer predicts token t+1), head k (0-based)
predicts token ``t + 2 + k``: head 0 guesses the token *after* the target's own next token.

Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` — every block with its own
parameters — followed by a vocabulary projection: either a per-head ``Linear(H, V)`` (the Medusa
paper) or the target's frozen output layer (``shared_lm_head=True``; small to ship: the output
layer is passed in, used with detached weights, and never saved). Blocks start at zero, so a
fresh head is the identity followed by the projection.

Checkpoint layout (the Medusa one, readable by engines that load Medusa heads): a directory with

    config.json          {"medusa_num_heads": K, "medusa_num_layers": n,
                          "base_model_name_or_path": ..., "hidden_size": H, "vocab_size": V,
                          "speculant_shared_lm_head": bool}
    model.safetensors    "{k}.{j}.linear.weight" (H, H), "{k}.{j}.linear.bias" (H,)  j < n
                         "{k}.{n}.weight" (V, H)   per-head projection (absent when shared)

``medusa_lm_head.safetensors`` (the name Medusa's own releases use) is read as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, ModelLoadError

__all__ = ["HeadsConfig", "MedusaHeads", "ResBlock", "load_heads", "save_heads"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ALT_WEIGHTS_NAMES = ("medusa_lm_head.safetensors",)


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of heads. ``base_model``: the target they were trained for (informative)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = True
    base_model: str = ""

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"heads {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ConfigError(f"heads num_layers must be an integer >= 0, got {self.num_layers!r}")

    def to_json(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "base_model_name_or_path": self.base_model, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "speculant_shared_lm_head": self.shared_lm_head}


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``, (..., H) -> (..., H); zero-initialised (starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads: ``forward(hidden (..., H)) -> logits (K, ..., V)``.

    ``lm_head``: the target's output layer ``(V, H)``. Required when ``config.shared_lm_head``
    (it is used, detached, as every head's projection and is not a parameter of this module);
    otherwise optional, and when given each head's projection starts as a copy of it.
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        if lm_head is not None:
            _check_lm_head(lm_head, config)
        elif config.shared_lm_head:
            raise ConfigError("shared_lm_head=True needs the target's output layer: pass "
                              "lm_head=model.get_output_embeddings()")
        # ModuleList of Sequential so that state_dict() names are Medusa's: "{k}.{j}.linear.weight".
        heads = []
        for _ in range(config.num_heads):
            layers: list[nn.Module] = [ResBlock(H) for _ in range(config.num_layers)]
            if not config.shared_lm_head:
                proj = nn.Linear(H, V, bias=False)
                if lm_head is not None:
                    with torch.no_grad():
                        proj.weight.copy_(lm_head.weight)
                layers.append(proj)
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)
        # a tuple hides the target's layer from parameters(), state_dict() and .to()
        self._shared: tuple[nn.Module, ...] = (lm_head,) if config.shared_lm_head else ()

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen shared projection (..., H) -> (..., V); gradients reach x, never the layer. A
        quantized output layer (the native backend's ``--quant-head``) is called as it is
        (inference only)."""
        layer = self._shared[0]
        if getattr(layer, "weight", None) is None:
            return layer(x.to(layer.dtype))
        weight = layer.weight.detach()
        bias = layer.bias.detach() if getattr(layer, "bias", None) is not None else None
        return F.linear(x.to(weight.dtype), weight, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V) in the projection's dtype."""
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must have shape (..., {self.config.hidden_size}), got {tuple(hidden.shape)}")
        x = hidden.to(self.dtype)
        outs = torch.stack([head(x) for head in self.heads])  # (K, ..., V), or (K, ..., H) when shared
        # shared: one projection of all K heads at once, so the (V, H) layer is read once, not K times
        return self._project(outs) if self._shared else outs

    @property
    def dtype(self) -> torch.dtype:
        p = next(self.parameters(), None)
        return p.dtype if p is not None else _layer_dtype(self._shared[0])

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Medusa's names (contiguous copies, ready for safetensors)."""
        return {name: t.detach().contiguous().clone() for name, t in self.heads.state_dict().items()}


def _layer_shape(layer: nn.Module) -> tuple[int, int] | None:
    """(V, H) of an output layer: a Linear's weight, or a quantized layer's (out, in) features."""
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.dim() == 2:
        return tuple(weight.shape)
    if isinstance(getattr(layer, "out_features", None), int) and isinstance(getattr(layer, "in_features", None), int):
        return layer.out_features, layer.in_features
    return None


def _layer_dtype(layer: nn.Module) -> torch.dtype:
    weight = getattr(layer, "weight", None)
    return weight.dtype if weight is not None else layer.dtype  # quantized layers: their activation dtype


def _check_lm_head(lm_head: nn.Module, config: HeadsConfig) -> None:
    shape = _layer_shape(lm_head)
    if shape is None:
        raise ConfigError("lm_head must be the target's output layer (a module with a (V, H) weight)")
    V, H = shape
    if H != config.hidden_size:
        raise ModelLoadError(
            f"the heads read hidden states of size {config.hidden_size} but the target's hidden size is {H}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")
    if V != config.vocab_size:
        raise ModelLoadError(
            f"the heads predict a vocabulary of {config.vocab_size} tokens but the target's output layer has {V}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")


def save_heads(heads: MedusaHeads, path: str | Path) -> Path:
    """Write ``heads`` to the directory ``path`` (created) in the Medusa layout; returns it."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(heads.config.to_json(), indent=2) + "\n")
    save_file(heads.medusa_state_dict(), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
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
            except Exception as e:  # safetensors raises its own error types for truncated / bad headers
                raise ModelLoadError(f"{directory / name} is corrupt ({e}); re-save or re-download the heads") from None
    hint = " (a .pt checkpoint: convert it to safetensors first)" if any(directory.glob("*.pt")) else ""
    raise ModelLoadError(f"{directory} has no {WEIGHTS_NAME}{hint}: a heads checkpoint needs its weights "
                         "in safetensors format")


def load_heads(path: str | Path, target_model: nn.Module, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Load heads saved in the Medusa layout for ``target_model`` (a transformers causal LM).

    Checks them against the target's output layer (hidden and vocabulary sizes). A checkpoint
    without ``speculant_shared_lm_head`` (e.g. from Medusa) is shared iff it has no projection
    weights. ``dtype``: default the target output layer's dtype.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"no heads checkpoint at {path}: expected a directory with {CONFIG_NAME} and "
                             f"{WEIGHTS_NAME} (train some with speculant train-heads)")
    raw = _read_config(directory)
    state = _read_weights(directory)
    lm_head = target_model.get_output_embeddings()
    shape = _layer_shape(lm_head)
    if shape is None:
        raise ModelLoadError("the target has no output layer with a (V, H) weight to check the heads against")
    V_t, H_t = shape
    K, n = raw["medusa_num_heads"], raw["medusa_num_layers"]
    has_proj = f"0.{n}.weight" in state
    shared = raw.get("speculant_shared_lm_head", not has_proj)
    # sizes the config does not state are read off the tensors (Medusa's own configs omit them)
    block, proj = state.get("0.0.linear.weight"), state.get(f"0.{n}.weight")
    hidden = raw.get("hidden_size") or (block.shape[1] if block is not None and block.dim() == 2 else
                                         proj.shape[1] if proj is not None and proj.dim() == 2 else H_t)
    vocab = raw.get("vocab_size") or (proj.shape[0] if proj is not None and proj.dim() == 2 else V_t)
    try:
        config = HeadsConfig(K, n, hidden, vocab, bool(shared),
                             str(raw.get("base_model_name_or_path") or ""))
    except ConfigError as e:
        raise ModelLoadError(f"{directory / CONFIG_NAME} is invalid: {e}") from None
    _check_lm_head(lm_head, config)  # hidden / vocabulary mismatch with the target
    with torch.device("meta"):  # no time spent initialising (V, H) projections about to be replaced
        heads = MedusaHeads(config, lm_head if shared else None)
    expected = heads.heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{directory} does not match its config ({K} heads x {n} blocks, "
            f"{'shared' if shared else 'per-head'} projection): "
            + (f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected tensors {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}" if unexpected else ""))
    for name, t in expected.items():
        if state[name].shape != t.shape:
            raise ModelLoadError(f"tensor {name} in {directory} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(t.shape)} from its config: the checkpoint is corrupt")
    heads.heads.load_state_dict(state, assign=True)
    return heads.to(dtype or _layer_dtype(lm_head)).eval()


SHIPPED_TREE_NAME = "tree.json"  # the default sparse tree shipped next to a heads checkpoint


def shipped_heads(target_name: str) -> Path | None:
    """The heads directory shipped in the package for a preset target (``data/heads/<preset>``), or None."""
    from importlib import resources

    d = Path(str(resources.files("speculant").joinpath("data", "heads", target_name)))
    return d if (d / CONFIG_NAME).is_file() else None


def heads_tree(path: str | Path | None) -> str | None:
    """The JSON list of paths stored as ``tree.json`` next to a heads checkpoint (by ``build-tree``), or None."""
    if path is None:
        return None
    f = Path(path) / SHIPPED_TREE_NAME
    return f.read_text() if f.is_file() else None
