"""Medusa / blockwise-parallel and sequential (Hydra) heads on the target's final (normed) hidden state.

Notation: H = hidden size, V = vocabulary size, K = number of heads. For the hidden state
``h_t`` of position t (the one whose output layer predicts token t+1), head k (0-based)
predicts token ``t + 2 + k``: head 0 guesses the token *after* the target's own next token.

Modules:

    config.py       HeadsConfig: the heads' shape (kind, K, blocks, H, V, draft vocabulary, context layer)
    layers.py       ResBlock, ContextLayer (prefix attention) and its decoding ContextCache
    attention.py    grouped_attention: few query rows against a growing decoding cache (also the EAGLE drafter's)
    projection.py   the target's frozen output layer: projection, shape checks, low-bit shortlists
    medusa.py       MedusaHeads: K independent heads (Medusa, BPD)
    sequential.py   SequentialHeads: one step function down a path of tokens (Hydra)
    checkpoint.py   make_heads, save_heads / load_heads (the Medusa directory layout), shipped heads

:class:`MedusaHeads` read the hidden state only; :class:`SequentialHeads` (``kind="sequential"``,
method ``hydra``) also read the tokens of the path they extend.
"""

from .checkpoint import (ALT_WEIGHTS_NAMES, CONFIG_NAME, SHIPPED_TREE_NAME, WEIGHTS_NAME, heads_tree, load_heads,
                         make_heads, save_heads, shipped_heads)
from .config import HEAD_KINDS, HeadsConfig
from .layers import ContextCache, ContextLayer, ResBlock
from .medusa import MedusaHeads
from .sequential import SequentialHeads

__all__ = ["ALT_WEIGHTS_NAMES", "CONFIG_NAME", "HEAD_KINDS", "SHIPPED_TREE_NAME", "WEIGHTS_NAME", "ContextCache",
           "ContextLayer", "HeadsConfig", "MedusaHeads", "ResBlock", "SequentialHeads", "heads_tree", "load_heads",
           "make_heads", "save_heads", "shipped_heads"]
