"""Shared test helpers: decoding a prompt to the end with any backend and drafter."""

from __future__ import annotations

import torch

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.decoding import DecodeState, decode

GREEDY = SamplingConfig()


def decode_to_end(target, drafter, prompt: torch.Tensor, n: int = 40, *, eos=(), sampling: SamplingConfig = GREEDY,
                  **options) -> DecodeState:
    """Run the decoding loop on ``prompt`` (T,) long until it stops (EOS in ``eos``, or ``n`` new
    tokens); return the final state. ``target``: a Backend, or a transformers model (wrapped in an
    HFBackend); ``options``: the rest of ``decode``'s keywords (generator, replacement, acceptance,
    pacer, ...)."""
    backend = HFBackend(target) if isinstance(target, torch.nn.Module) else target
    state = None
    for state, _ in decode(backend, drafter, prompt, max_new_tokens=n, sampling=sampling,
                           eos_token_ids=set(eos), **options):
        pass
    return state
