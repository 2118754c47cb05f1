"""Training Medusa heads: pure losses, self-distillation data, the training loop, calibration.

Pipeline::

    data.distill(decoder, data.mixed_prompts(...), max_new_tokens, "distill.jsonl")  # target answers
    train.train_heads(target, HeadsConfig(...), "distill.jsonl", "heads/", mode="medusa1")
    accuracy.build_tree(target, load_heads("heads/", target.model), calib, budget, out_path="tree.json")

Submodules are imported lazily (``peft`` and ``accelerate`` only when training).
"""

from __future__ import annotations

from .losses import combined_loss, lm_loss, medusa_loss

__all__ = ["build_tree", "combined_loss", "distill", "head_topk_accuracy", "lm_loss", "medusa_loss",
           "mixed_prompts", "stdlib_prompts", "train_heads", "wmt_prompts", "TrainConfig"]

_LAZY = {"build_tree": "accuracy", "head_topk_accuracy": "accuracy", "distill": "data",
         "mixed_prompts": "data", "stdlib_prompts": "data", "wmt_prompts": "data",
         "train_heads": "train", "TrainConfig": "train"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
