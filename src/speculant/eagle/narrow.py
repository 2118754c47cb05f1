"""A trained EAGLE drafter with a narrower MLP, the start of a cheaper drafter
(``train-eagle --init DIR --intermediate-size N``): fine-tuning it costs a fraction of training a
narrow drafter from the start.

The MLP is f(a) = a + down(silu(gate(x)) * up(x)), x = RMSNorm(a): a sum over its I units, unit j
adding silu(gate_j . x) (up_j . x) down[:, j]. The units kept are those whose terms are largest on a
sample of training windows, mean |silu(gate_j . x)(up_j . x)| x |down[:, j]| (the magnitude each
adds to the output); the others' terms are dropped. Every other weight, the draft vocabulary and
the input scale are kept. Shapes: B windows of T pairs, H hidden size, I units.

A trained drafter can also take another draft vocabulary (``train-eagle --init DIR --draft-vocab N``,
:func:`with_draft_vocab`): it projects through the target's frozen output layer, so its weights
stay and only the list of token ids it ranks changes (a drafter fine-tuned on text of other words).

And it can start reading more of the target (``train-eagle --init DIR --fuse-layers I,J``,
:func:`with_fused_layers`): EAGLE-3's low- and mid-level states join its input through a new
projection that starts at zero, so fine-tuning starts from exactly the drafter it was.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .model import EagleModel

__all__ = ["check_width", "narrow_mlp", "unit_importance", "with_draft_vocab", "with_fused_layers"]


def check_width(model: EagleModel, width: int) -> None:
    """A ConfigError unless ``model``'s MLP can be narrowed to ``width`` units."""
    have = model.config.intermediate_size
    if not isinstance(width, int) or not 1 <= width <= have:
        raise ConfigError(f"a drafter's MLP can be narrowed to 1 .. {have} units (its own width), not {width}")


@torch.no_grad()
def unit_importance(model: EagleModel, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each MLP unit's mean output magnitude (I,) float32 on the teacher-forced pass of ``hidden``
    (B, T, H) and ``tokens`` (B, T) (:meth:`EagleModel.forward`'s inputs)."""
    mlp = model.layers[0].mlp
    seen: list[torch.Tensor] = []
    hook = mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    try:
        model(hidden.to(model.dtype), tokens)
    finally:
        hook.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1]).float()
    terms = F.silu(x @ mlp.gate_proj.weight.float().T) * (x @ mlp.up_proj.weight.float().T)  # (B T, I)
    return terms.abs().mean(0) * mlp.down_proj.weight.float().norm(dim=0)


@torch.no_grad()
def narrow_mlp(model: EagleModel, width: int, hidden: torch.Tensor, tokens: torch.Tensor) -> EagleModel:
    """A new drafter: ``model`` with only the ``width`` MLP units of largest :func:`unit_importance`
    on the sample ``hidden`` (B, T, H) / ``tokens`` (B, T), in their original order."""
    check_width(model, width)
    keep = unit_importance(model, hidden, tokens).topk(width).indices.sort().values
    config = dataclasses.replace(model.config, intermediate_size=width)
    out = EagleModel(config, model.output_layer, model.input_embeddings).to(model.dtype)
    state = model.state_dict()
    for name in ("gate_proj", "up_proj"):
        key = f"layers.0.mlp.{name}.weight"
        state[key] = state[key][keep]
    state["layers.0.mlp.down_proj.weight"] = state["layers.0.mlp.down_proj.weight"][:, keep]
    out.load_weights(state)
    return out.eval()


@torch.no_grad()
def with_draft_vocab(model: EagleModel, ids: torch.Tensor) -> EagleModel:
    """A new drafter: ``model`` proposing from the token ids ``ids`` (n,) (distinct, < V) instead of
    its own draft vocabulary (of any size); every weight is kept."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    config = dataclasses.replace(model.config, draft_vocab=int(ids.numel()))
    out = EagleModel(config, model.output_layer, model.input_embeddings).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items() if k != "draft_vocab"}
    state["draft_vocab"] = out.draft_vocab
    out.load_weights(state)
    out.set_draft_vocab(ids)
    return out.eval()


@torch.no_grad()
def with_fused_layers(model: EagleModel, layers: tuple[int, ...], states: torch.Tensor) -> EagleModel:
    """A new drafter: ``model`` (which reads no fused layers) reading the target's states entering
    ``layers`` too, through a zero ``fuse`` (so it computes what ``model`` does) whose input scale
    comes from ``states`` (n, W), a sample of the target's [h ; g] rows. Every weight is kept."""
    if model.config.fused_layers:
        raise ConfigError(f"the drafter already reads layers {list(model.config.fused_layers)}")
    config = dataclasses.replace(model.config, fused_layers=tuple(layers))
    if states.shape[-1] != config.state_width:
        raise ConfigError(f"states of width {states.shape[-1]} for a drafter reading {len(layers)} fused layers "
                          f"(width {config.state_width})")
    out = EagleModel(config, model.output_layer, model.input_embeddings).to(model.dtype)
    out.init_fusion(states)
    state = out.state_dict()
    state.update(model.state_dict())
    out.load_weights(state)
    return out.eval()
