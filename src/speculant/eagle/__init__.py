"""The EAGLE-style drafter (method ``eagle``): one decoder layer over the target's own features
and the tokens drafted so far, with its own KV cache, drafting EAGLE-2's dynamic tree.

    model.py     EagleConfig, EagleModel (the network, EAGLE's parameter layout), EagleCache
    drafter.py   EagleDrafter: the drafter of the decoding loop (commit pairs, grow the tree)
    checkpoint.py, export.py   saving and loading; EAGLE-1 draft models for vLLM / SGLang
    train.py     features, training, held-out accuracy by depth
    narrow.py    a trained drafter with a narrower MLP (the start of a cheaper one)
"""

from .drafter import EagleDrafter
from .model import EagleCache, EagleConfig, EagleModel

__all__ = ["EagleCache", "EagleConfig", "EagleDrafter", "EagleModel"]
