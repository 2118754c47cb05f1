"""One EAGLE training run as ``train-eagle`` and ``train-drafter`` make it: the target's features
on the records (computed once, resumable), a drafter (new, or a trained one to start from, with
its MLP narrowed or its draft vocabulary ranked again), and the training (resumable), all under
one output directory: ``OUT/features``, ``OUT/checkpoints``, the drafter and its report in ``OUT``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError
from .eagle_train import EagleTrainConfig, compute_features, load_features, split_records, train_eagle, window_sample

__all__ = ["EagleRun", "run_eagle_training"]


@dataclass(frozen=True)
class EagleRun:
    """What a run starts from besides its training config. ``init``: a trained drafter's
    directory; ``intermediate_size`` 0: the target's width (or the initial drafter's);
    ``draft_vocab`` None: 32,768 for a new drafter, the initial drafter's list with ``init``
    (0: the whole vocabulary); ``depth``: the deepest draft; ``fuse_layers``: the target layers whose
    input states the drafter reads beside the final one (EAGLE-3's fusion), None: the initial
    drafter's (none for a new one)."""

    init: str | None = None
    intermediate_size: int = 0
    draft_vocab: int | None = None
    depth: int = 6
    fuse_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ConfigError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        if self.intermediate_size < 0 or self.depth < 1:
            raise ConfigError("--intermediate-size must be >= 0 and --depth >= 1")
        if self.fuse_layers is not None and len(set(self.fuse_layers)) != len(self.fuse_layers):
            raise ConfigError(f"--fuse-layers names a layer twice: {list(self.fuse_layers)}")


def run_eagle_training(decoder, records: Sequence[dict], out: str | Path, cfg: EagleTrainConfig,
                       run: EagleRun = EagleRun(), vocab_records: Sequence[dict] | None = None,
                       features_only: bool = False) -> dict:
    """Train an EAGLE drafter for ``decoder``'s target (a SpeculativeDecoder: the runtime whose
    hidden states the drafter reads) on ``records``; see the module docstring. ``vocab_records``
    rank the draft vocabulary (default: the records trained on, so the held-out accuracy stays
    held out). Returns the training report, or with ``features_only`` what the features hold."""
    from .vocab import draft_vocabulary
    from ..eagle.checkpoint import is_eagle_dir, load_eagle
    from ..eagle.model import EagleConfig, EagleModel
    from ..eagle.narrow import check_width, narrow_mlp, with_draft_vocab, with_fused_layers
    from ..backends.base import check_layers

    if run.init and not is_eagle_dir(run.init):  # before the features, which can take hours
        raise ConfigError(f"--init {run.init}: no EAGLE drafter there (a directory written by train-eagle)")
    target = decoder.target.model
    init = load_eagle(run.init, target, dtype=torch.float32) if run.init else None
    narrow = init is not None and run.intermediate_size and run.intermediate_size != init.config.intermediate_size
    if narrow:
        check_width(init, run.intermediate_size)
    layers = run.fuse_layers if run.fuse_layers is not None else init.config.fused_layers if init is not None else ()
    try:
        layers = check_layers(layers, target.config.num_hidden_layers)
    except ValueError as e:
        raise ConfigError(f"--fuse-layers: {e}") from None
    if init is not None and init.config.fused_layers and init.config.fused_layers != layers:
        raise ConfigError(f"--init {run.init} reads layers {list(init.config.fused_layers)}; it cannot be "
                          f"trained on layers {list(layers)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    feats = out / "features"
    try:
        features = load_features(feats, records, layers)
    except (ConfigError, OSError, KeyError):
        features = load_features(compute_features(decoder.target_backend, records, feats, layers=layers), records,
                                 layers)
    if features_only:
        return {"features": str(feats), "records": len(records), "rows": int(features[1][-1])}
    V = decoder.target.logits_dim
    ranked = vocab_records or [records[r] for r in split_records(len(records), cfg.held_out)[1]]
    if init is not None:
        model = narrow_mlp(init, run.intermediate_size, *window_sample(records, features, cfg.held_out)) \
            if narrow else init
        if layers and not model.config.fused_layers:  # it starts as it was: the new inputs' weights zero
            model = with_fused_layers(model, layers, features[0][:65536])
        if run.draft_vocab is not None:  # 0: all V tokens
            model = with_draft_vocab(model, draft_vocabulary(ranked, min(run.draft_vocab or V, V), V))
    else:
        size = 32768 if run.draft_vocab is None else run.draft_vocab
        ecfg = EagleConfig.for_target(target.config, intermediate_size=run.intermediate_size or None,
                                      depth=run.depth, draft_vocab=min(size, V), input_scale=True,
                                      fused_layers=layers)
        ecfg = dataclasses.replace(ecfg, vocab_size=V, base_model=decoder.target.name)
        model = EagleModel(ecfg, target.get_output_embeddings(), target.get_input_embeddings())
        if ecfg.draft_vocab:
            model.set_draft_vocab(draft_vocabulary(ranked, ecfg.draft_vocab, V))
        model = model.to(torch.float32)
        model.init_for_training(features[0][:65536], seed=cfg.seed)
    return train_eagle(model, records, features, out, cfg)
