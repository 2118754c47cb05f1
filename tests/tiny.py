"""Tiny randomly initialised models for fast end-to-end tests."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 48, layers: int = 2, scale: float = 1.0):
    """A 2-layer Llama with random weights (fp32). ``scale`` sharpens its distributions."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def perturbed(model, noise: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise on every weight: a draft that mostly agrees."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    return other
