"""A GGUF file's Q4_K, Q5_K and Q6_K layers (runtime.kquant.KQuantLinear) and Q4_0, Q4_1, Q5_0,
Q5_1 and Q8_0 ones (runtime.block_quant.BlockQuantLinear) run as they are (store.gguf_linears.apply_gguf_blocks): the layer is the file's weights, bit for bit when
de-quantized, and its product the exact kernel's; joined layers give each part's bits; the
query/key row order of llama.cpp's converter is undone; on the default target every Q4_K and
Q6_K layer is replaced (the output layer too), and speculative decoding on it is plain decoding's
output."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from speculant.kernels import x86_kernels
from speculant.runtime.gguf_blocks import LEGACY, dequantize_legacy, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k
from speculant.store.gguf_linears import permuted_rows

from test_kernels_kquant import random_q4k
from test_kernels_kquant_wide import random_q5k, random_q6k
from test_gguf_legacy import random_legacy

pytestmark = pytest.mark.skipif(x86_kernels() is None, reason="needs an x86-64 CPU and a C++ toolchain")


KINDS = {"Q4_K": (random_q4k, dequantize_q4_k, 0.015), "Q5_K": (random_q5k, dequantize_q5_k, 0.015),
         "Q6_K": (random_q6k, dequantize_q6_k, 0.01),
         **{kind: (partial(random_legacy, kind), partial(dequantize_legacy, kind=kind), 0.015) for kind in LEGACY}}


def layer_class(kind: str):
    from speculant.runtime.block_quant import BlockQuantLinear
    from speculant.runtime.kquant import KINDS as K_QUANTS, KQuantLinear

    return KQuantLinear if kind in K_QUANTS else BlockQuantLinear


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_layer_of_the_files_blocks_is_its_weights_and_joins_bit_for_bit(kind):
    random_blocks, dequantize, tolerance = KINDS[kind]
    cls = layer_class(kind)
    a_raw, b_raw = random_blocks(32, 512, seed=3), random_blocks(48, 512, seed=4)
    bias = torch.randn(32)
    a, b = cls.from_blocks(a_raw, bias, kind=kind), cls.from_blocks(b_raw, kind=kind)
    assert a.kind == kind and f"{kind} as in the file" in repr(a)
    assert torch.equal(a.dequantize(), torch.from_numpy(dequantize(a_raw)))
    x = torch.randn(5, 512).bfloat16()
    ya, yb = a.forward_float(x), b.forward_float(x)
    exact = x.float() @ a.dequantize().T + bias  # up to the activations' int8 rounding
    assert (ya - exact).norm() / exact.norm() < tolerance
    for m in range(5):  # row-invariant, Q8_0's two planes included
        assert torch.equal(a.forward_float(x[m:m + 1]), ya[m:m + 1])
    both = cls.concat([a, b])
    assert both.out_features == 80 and torch.equal(both.forward_float(x), torch.cat([ya, yb], -1))
    # a is now a view of the joined buffers: the same bits
    assert torch.equal(a.forward_float(x), ya) and torch.equal(a.forward(x), ya.bfloat16())
    order = np.random.default_rng(0).permutation(32)
    moved = cls.from_blocks(a_raw, None, order, kind=kind)
    assert torch.equal(moved.dequantize(), a.dequantize()[torch.from_numpy(order)])
    with pytest.raises(ValueError, match="multiples of 16"):
        a.rows(0, 8)
    some = torch.tensor([31, 0, 17, 17, 5])
    assert torch.equal(a.dequantize_rows(some), a.dequantize()[some].bfloat16())


def test_layers_of_two_types_do_not_join():
    from speculant.runtime.block_quant import BlockQuantLinear
    from speculant.runtime.kquant import KQuantLinear

    six, four = KQuantLinear.from_blocks(random_q6k(16, 512), kind="Q6_K"), KQuantLinear.from_blocks(random_q4k(16, 512))
    with pytest.raises(ValueError, match="one type"):
        KQuantLinear.concat([six, four])
    eight = BlockQuantLinear.from_blocks(random_legacy("Q8_0", 16, 512), kind="Q8_0")
    with pytest.raises(ValueError, match="one type"):
        BlockQuantLinear.concat([eight, four])


def test_the_rotary_row_order_of_llama_cpps_converter_is_undone():
    heads, half, K = 2, 4, 8
    hf = np.arange(heads * 2 * half * K, dtype=np.float32).reshape(heads * 2 * half, K)
    # llama.cpp's converter: reshape (heads, 2, half, K), swap the middle axes
    file = hf.reshape(heads, 2, half, K).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(file[permuted_rows(hf.shape[0], heads)], hf)
    assert sorted(permuted_rows(16, 2)) == list(range(16))


@pytest.mark.real
def test_the_default_targets_q4_k_layers_run_as_in_the_file_and_speculation_stays_exact(tmp_path):
    from speculant import SpeculativeDecoder
    from speculant.runtime.kquant import KQuantLinear
    from speculant.store.gguf_linears import apply_gguf_blocks, source_gguf
    from speculant.store.loading import load_native

    target = load_native("qwen2.5-coder-1.5b-instruct", "bfloat16", "int4", True)
    report = apply_gguf_blocks(target.model, source_gguf("qwen2.5-coder-1.5b-instruct"))
    assert report["q4_k"] == 168 and report["q6_k"] == 29 and not report["kept"] and not report["mismatched"]
    block = target.model.blocks[0]
    assert block.q_proj.kind == "Q4_K" and block.v_proj.kind == "Q6_K"  # attn_v of layer 0 is Q6_K
    assert block.qkv is None and isinstance(block.gate_up, KQuantLinear)  # q, k and v: two types, no join
    assert target.model.lm_head.kind == "Q6_K"  # the output layer, its logits in float32
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    plain = SpeculativeDecoder(target, method="ar", chat=True).generate(prompt, 32)
    assert "def " in plain.text
    spec = SpeculativeDecoder(target, method="auto", chat=True, pacing=False).generate(prompt, 32)
    assert spec.token_ids == plain.token_ids and spec.stats.target_calls < plain.stats.target_calls
    # the same through the decoder's option, with its runtime said
    dec = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", method="ar", chat=True, target_quant="gguf")
    assert dec.generate(prompt, 32).token_ids == plain.token_ids
    assert any("own blocks (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as they are" in r for r in dec.plan.reasons), dec.plan.reasons
    assert source_gguf(target.path) == source_gguf("qwen2.5-coder-1.5b-instruct")  # its conversion's source
    with pytest.raises(Exception, match="not a GGUF file or a preset"):
        source_gguf(tmp_path)  # a directory that is no conversion of a GGUF file


@pytest.mark.real
def test_the_draft_models_q5_0_and_q8_0_layers_run_as_in_the_file():
    """The 0.5B draft's Q4_K_M file holds Q5_0, Q8_0, Q4_K and Q6_K projections: every one runs the
    file's own blocks, and its decoding with its own blocks is the same whatever drafts for it."""
    from speculant import SpeculativeDecoder
    from speculant.store.gguf_linears import apply_gguf_blocks, source_gguf
    from speculant.store.loading import load_native

    draft = load_native("qwen2.5-coder-0.5b-instruct", "bfloat16", "int4", True)
    report = apply_gguf_blocks(draft.model, source_gguf("qwen2.5-coder-0.5b-instruct"))
    assert report["q5_0"] and report["q8_0"] and report["q4_k"] and report["q6_k"], report
    assert not report["kept"] and not report["mismatched"], report
    kinds = {getattr(b, p).kind for b in draft.model.blocks for p in ("q_proj", "k_proj", "v_proj", "down_proj")}
    assert {"Q5_0", "Q8_0"} <= kinds
    prompt = "Write a Python function that checks whether a string is a palindrome."
    plain = SpeculativeDecoder(draft, method="ar", chat=True).generate(prompt, 32)
    spec = SpeculativeDecoder(draft, method="lookup", chat=True, pacing=False).generate(prompt, 32)
    assert "def " in plain.text and spec.token_ids == plain.token_ids


def test_load_native_takes_gguf_as_every_loader_does(monkeypatch):
    """``speculant bench --target-quant gguf`` (and the demo) load through load_native: "gguf" there is
    the int4 model with the file's Q4_K blocks, not an unknown quantization."""
    from speculant.store import loading

    calls = []
    monkeypatch.setattr(loading, "_with_gguf_blocks", lambda spec, dtype, quant_head: calls.append((spec, quant_head)) or "m")
    assert loading.load_native("some-model", "bfloat16", "gguf", True) == "m"
    assert calls == [("some-model", True)]
