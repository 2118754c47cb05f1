"""Packed (oneDNN-blocked) bf16 linear layers: same results as the plain model, reversible."""

from __future__ import annotations

import copy

import pytest
import torch

from speculant.runtime import packing
from speculant.backends.base import HiddenNeed
from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeModel
from speculant.config import SamplingConfig
from speculant.kernels import cpu_kernels
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.runtime.packing import PackedLinear, is_packed, pack_linears, unpack_linears
from speculant.trees.buffers import build_tree

from helpers import decode_to_end
from tiny import fixed_prompts, perturbed, tiny_qwen2

pytestmark = pytest.mark.skipif(not packing.available(), reason="no oneDNN bf16 linear on this CPU / torch build")


def bf16_qwen(seed=0, tied=True):
    return tiny_qwen2(seed=seed, tied=tied, scale=4.0, dtype=torch.bfloat16)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_passes_equal_plain(tied):
    plain = bf16_qwen(tied=tied)
    packed = copy.deepcopy(plain)
    a, b = HFBackend(plain, pack=False), HFBackend(packed)
    assert not is_packed(plain)
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 2 * 7 + 1  # q k v o gate up down per layer, and the output layer
    # speculant's AMX kernel where it builds (every size of this model is a multiple of 32), else oneDNN's
    assert all(m.own == (cpu_kernels() is not None) for m in layers)
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))
    tree = build_tree("3x2x1")
    with torch.inference_mode():
        for be in (a, b):
            be.reset()
        outs = [be.forward(prompt, want_hidden=HiddenNeed.LAST) for be in (a, b)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=0)
        torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=0, atol=0)
        toks = torch.randint(0, 64, (tree.size,), generator=torch.Generator().manual_seed(1))
        outs = [be.forward(toks, positions=40 + tree.depths, tree_mask=tree.mask) for be in (a, b)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=0)


def test_greedy_outputs_identical_to_the_plain_model():
    """Plain decoding, speculative decoding and multi-candidate decoding on packed bf16 models give
    the plain bf16 model's greedy text."""
    target = bf16_qwen()
    draft = perturbed(target, noise=0.3)
    packed_target, packed_draft = copy.deepcopy(target), copy.deepcopy(draft)
    for prompt in fixed_prompts(64):
        ref = decode_to_end(HFBackend(target, pack=False), NoDrafter(), prompt, n=30).generated
        assert decode_to_end(HFBackend(packed_target), NoDrafter(), prompt, n=30).generated == ref
        for tree in ("4", "4x2x2x1"):
            drafter = DraftModelDrafter(HFBackend(packed_draft), build_tree(tree), SamplingConfig(), 64)
            assert decode_to_end(HFBackend(packed_target), drafter, prompt, n=30).generated == ref
    assert is_packed(packed_target) and is_packed(packed_draft)


@pytest.mark.parametrize("tied", [True, False])
def test_unpack_restores_the_exact_weights(tied):
    plain = bf16_qwen(seed=3, tied=tied)
    model = copy.deepcopy(plain)
    count = pack_linears(model)
    assert count == 15 and pack_linears(model) == 0  # packing twice is a no-op
    assert model.get_output_embeddings().weight is not None  # heads project through it
    assert unpack_linears(model) == 15 and not is_packed(model)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_float32_models_are_left_alone():
    model = tiny_qwen2(seed=0)
    assert pack_linears(model) == 0
    HFBackend(model)
    assert not is_packed(model)


def test_native_backend_and_quantization_take_a_packed_model():
    """Code that needs nn.Linear weights unpacks first: the native backend built from a packed
    model computes the plain model's logits."""
    plain = bf16_qwen(seed=4)
    model = copy.deepcopy(plain)
    HFBackend(model)
    assert is_packed(model)
    native = NativeModel.from_hf(model)
    assert not is_packed(model)
    ref = NativeModel.from_hf(plain)
    prompt = torch.arange(1, 20)
    with torch.inference_mode():
        from speculant.backends.native import NativeBackend
        x, y = NativeBackend(native), NativeBackend(ref)
        torch.testing.assert_close(x.forward(prompt).logits, y.forward(prompt).logits, rtol=0, atol=0)


def test_onednn_layout_where_the_kernels_do_not_run(monkeypatch):
    """Without speculant's kernels (or for sizes not multiples of 32) layers take oneDNN's layout:
    the same logits, and unpacking still gives the exact weights back."""
    monkeypatch.setattr(packing, "cpu_kernels", lambda: None)
    plain = bf16_qwen(seed=5)
    model = copy.deepcopy(plain)
    a, b = HFBackend(plain, pack=False), HFBackend(model)
    assert all(not m.own for m in model.modules() if isinstance(m, PackedLinear))
    prompt = torch.arange(3, 30)
    with torch.inference_mode():
        torch.testing.assert_close(b.forward(prompt).logits, a.forward(prompt).logits, rtol=0, atol=0)
    unpack_linears(model)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["sequential", "medusa"])
def test_heads_loaded_by_the_decoder_are_packed_and_stay_lossless(tmp_path, kind):
    """Heads the decoder loads from a directory get packed layers too (bf16); their drafts equal
    the unpacked heads' and greedy output equals plain decoding."""
    import speculant
    from speculant import SpeculativeDecoder
    from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads, load_heads, save_heads
    from tiny import tiny_model_dir

    lm = speculant.load(tiny_model_dir(tmp_path / "m"), "bfloat16")
    cfg = HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim, kind=kind)
    torch.manual_seed(0)
    if kind == "sequential":
        heads = SequentialHeads(cfg, lm.model.get_output_embeddings(), lm.model.get_input_embeddings())
    else:
        heads = MedusaHeads(cfg, lm.model.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    save_heads(heads.to(torch.bfloat16), tmp_path / "h")
    method = "hydra" if kind == "sequential" else "medusa"
    dec = SpeculativeDecoder(lm, method=method, heads=str(tmp_path / "h"), dtype="bfloat16")
    assert is_packed(dec.heads) == (packing.available())
    plain = load_heads(tmp_path / "h", lm.model)
    assert not is_packed(plain)
    x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        if kind == "sequential":
            toks = torch.randint(0, 60, (5, 3))
            torch.testing.assert_close(dec.heads.unroll(x, toks), plain.unroll(x, toks))
        else:
            torch.testing.assert_close(dec.heads(x), plain(x))
    ar = SpeculativeDecoder(lm, method="ar", dtype="bfloat16")
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3"
    assert dec.generate(prompt, 24).token_ids == ar.generate(prompt, 24).token_ids
