"""The native model that runs a GGUF file's own blocks is saved once per machine
(backends.native_gguf_store): a later load of the file with target_quant "gguf" reads it back,
without reading the file's blocks or building the int4 model, and gives the same logits and hidden
states bit for bit; a damaged file is named and rebuilt, a file of another format left unread, and
a changed source is another file.

A tiny Llama GGUF whose layers are of every type the blocks run (Q4_K, Q5_K and Q6_K as random
blocks, the 32-weight types quantized by gguf-py) and one F32 layer (kept in int4) is written here,
so nothing needs a real model."""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch

from speculant.backends.base import HiddenNeed
from speculant.backends.native import NativeBackend, NativeModel
from speculant.kernels import x86_kernels
from speculant.trees.buffers import build_tree

from test_gguf_legacy import random_legacy
from test_kernels_kquant import random_q4k
from test_kernels_kquant_wide import random_q5k, random_q6k
from tiny import llama_gguf_writer, tiny_qwen2

pytestmark = pytest.mark.skipif(x86_kernels() is None, reason="needs an x86-64 CPU and a C++ toolchain")

RANDOM_BLOCKS = {"Q4_K": random_q4k, "Q5_K": random_q5k, "Q6_K": random_q6k,
                 **{k: partial(random_legacy, k) for k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}}
# each layer's type in the file: q/k/v of one type (joined), gate/up of one type (joined), a
# layer of two types side by side (not joined), an F32 tensor (int4)
PLAN = {0: dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q4_K", attn_output="Q8_0", ffn_gate="Q5_0", ffn_up="Q5_0",
                ffn_down="Q6_K"),
        1: dict(attn_q="Q4_0", attn_k="F32", attn_v="Q5_1", attn_output="Q4_1", ffn_gate="Q5_K", ffn_up="Q5_K",
                ffn_down="Q8_0")}


def write_gguf(path, hidden: int = 256, ffn: int = 512, vocab: int = 64, heads: int = 4, kv: int = 2):
    """A Llama GGUF of PLAN's types (a Q6_K output layer), random weights."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    w = llama_gguf_writer(path, "tiny", vocab, hidden, len(PLAN), heads, kv, ffn)
    rng = np.random.default_rng(0)
    D = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv * D, hidden), "attn_v": (kv * D, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}

    def add(name: str, kind: str, shape: tuple[int, int], seed: int) -> None:
        if kind.endswith("_K"):
            w.add_tensor(name, RANDOM_BLOCKS[kind](*shape, seed=seed), raw_dtype=T[kind])
            return
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, T[kind]), raw_dtype=T[kind])

    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    for i, kinds in PLAN.items():
        for n, kind in kinds.items():
            add(f"blk.{i}.{n}.weight", kind, shapes[n], seed=10 * i + len(n))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", "Q6_K", (vocab, hidden), seed=99)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def passes(model: NativeModel) -> list[torch.Tensor]:
    """A model's logits over a few tokens, then a tree pass's logits and hidden states (the final
    ones and layer 1's input) after them."""
    backend = NativeBackend(model)
    tokens = torch.tensor([1, 5, 9, 3, 40, 22, 7, 63])
    out = [backend.forward(tokens).logits]
    tree = build_tree("3x2x1")
    nodes = torch.randint(0, 64, (tree.size,), generator=torch.Generator().manual_seed(0))
    wide = backend.forward(nodes, len(tokens) + tree.depths, tree.mask, want_hidden=HiddenNeed.ALL, layers=(1,))
    return out + [wide.logits, wide.hidden]


def layout(model: NativeModel) -> list:
    """Each layer's class and kind, and whether q/k/v and gate/up are joined."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv", "gate_up")
    desc = lambda l: None if l is None else (type(l).__name__, getattr(l, "kind", None), l.out_features, l.in_features)
    return [[desc(getattr(b, n)) for n in names] for b in model.blocks] + [desc(model.lm_head)]


def test_the_gguf_block_model_is_saved_once_and_read_back_bit_identical(tmp_path, monkeypatch, capsys):
    from speculant.backends import native_gguf_store, native_store
    from speculant.runtime.block_linear import BlockLinear
    from speculant.runtime.quant import Int4Linear
    from speculant.store import gguf_linears
    from speculant.store.loading import load_native

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    g = write_gguf(tmp_path / "tiny.gguf")
    first = load_native(str(g), "bfloat16", "gguf", quant_head=True)
    err = capsys.readouterr().err
    summary = ("speculant: 14 layers run tiny.gguf's own blocks (3 Q4_K, 2 Q5_K, 2 Q6_K, 1 Q4_0, 1 Q4_1, 2 Q5_0, "
               "1 Q5_1, 2 Q8_0); int4 for the rest (1 F32 in the file)")
    assert summary + "\n" in err and "own blocks once for this machine; saved to" in err
    saved = list((tmp_path / "cache" / "native").glob("*-gguf-*.safetensors"))
    assert len(saved) == 1 and saved[0].name.endswith("-gguf-x86-g64-head-v1.safetensors")
    assert list((tmp_path / "cache" / "native").glob("*-int4-x86-g64-head-v1.safetensors"))  # the int4 one beside it
    b0, b1 = first.model.blocks
    assert isinstance(b0.qkv, BlockLinear) and b0.qkv.kind == "Q4_K" and b0.gate_up.kind == "Q5_0"
    assert b1.qkv is None and isinstance(b1.k_proj, Int4Linear) and b1.q_proj.kind == "Q4_0"
    assert first.model.lm_head.kind == "Q6_K" and first.model.quant == "gguf"
    want = passes(first.model)
    assert all(torch.isfinite(t).all() for t in want)

    # read back: neither the file's blocks nor the int4 model
    monkeypatch.setattr(gguf_linears, "apply_gguf_blocks", lambda *a: pytest.fail("read the file's blocks again"))
    monkeypatch.setattr(NativeModel, "from_dir", lambda *a, **k: pytest.fail("built the int4 model"))
    second = load_native(str(g), "bfloat16", "gguf", quant_head=True)
    assert capsys.readouterr().err == f"{summary}; read from the saved copy {saved[0]}\n"
    assert layout(second.model) == layout(first.model) and second.model.quant == "gguf"
    got = passes(second.model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    s0 = second.model.blocks[0]
    assert s0.q_proj.qweight.data_ptr() == s0.qkv.qweight.data_ptr()  # the parts are views of the joined layer
    assert second.name == first.name and second.tokenizer("a b").input_ids == first.tokenizer("a b").input_ids
    monkeypatch.undo()
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    del second  # it maps the file: replace the file (a new inode), as every writer here does

    # a truncated file is named and rebuilt; a killed save's temporary file is removed
    data = saved[0].read_bytes()
    cut = saved[0].with_name("cut")
    cut.write_bytes(data[:len(data) // 2])
    cut.replace(saved[0])
    left = saved[0].with_name(f".{saved[0].name}.12345.tmp")
    left.write_bytes(b"half a file")
    third = load_native(str(g), "bfloat16", "gguf", quant_head=True)
    err = capsys.readouterr().err
    assert f"ignoring the saved gguf-block model {saved[0]}" in err and "rebuilding it" in err
    assert f"removing {left}, left by an interrupted save of the gguf-block model" in err and not left.exists()
    assert all(torch.equal(a, b) for a, b in zip(want, passes(third.model)))
    cfg = third.model.config
    assert native_gguf_store.load_gguf_store(saved[0], cfg, None, torch.bfloat16) is not None  # rewritten
    del third

    # a file of another format (here the int4 model's) is not read, and is replaced
    int4 = next((tmp_path / "cache" / "native").glob("*-int4-*.safetensors"))
    assert native_store.load_store(int4, cfg, None, torch.bfloat16) is not None
    assert native_gguf_store.load_gguf_store(int4, cfg, None, torch.bfloat16) is None
    assert capsys.readouterr().err == ""  # quietly
    saved[0].write_bytes(int4.read_bytes())
    fourth = load_native(str(g), "bfloat16", "gguf", quant_head=True)
    assert "saved to" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(want, passes(fourth.model)))
    assert native_gguf_store.load_gguf_store(saved[0], cfg, None, torch.bfloat16) is not None


def test_a_changed_source_is_another_file(tmp_path, monkeypatch):
    from speculant.backends.native_gguf_store import gguf_store_path
    from speculant.backends.native_store import store_path

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m"
    src.mkdir()
    weights = src / "model.safetensors"
    weights.write_bytes(b"weights")
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF blocks")
    name = lambda: gguf_store_path(src, [weights], g, True, "x86", 64).name
    first = name()
    assert first == name() and "-gguf-x86-g64-head-v1" in first
    assert first != store_path(src, [weights], True, "x86", 64).name  # never the int4 model's file
    assert gguf_store_path(src, [weights], g, False, "x86", 64).name != first
    st = g.stat()
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF file touched
    second = name()
    assert second != first
    g.write_bytes(b"GGUF blocks, more")  # and changed
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert name() not in (first, second)
    third = name()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))  # the converted weights
    assert name() != third


def mixed(head: str) -> NativeModel:
    """A tiny int4 Qwen2 (q/k/v biases) whose layers are replaced by random blocks as
    apply_gguf_blocks replaces them: joined where one type, side by side otherwise, some int4; the
    output layer a block layer, int4, dense or the embedding (``head``)."""
    from speculant.store.gguf_linears import _join, _layer_class

    hf = tiny_qwen2(seed=5, hidden=256, tied=head == "tied", scale=4.0, dtype=torch.bfloat16)
    model = NativeModel.from_hf(hf, "int4", quant_head=head in ("block", "int4"), keep_dense=False)
    plan = [dict(q_proj="Q4_K", k_proj="Q4_K", v_proj="Q4_K", o_proj="Q8_0", gate_proj="Q5_0", up_proj="Q5_0",
                 down_proj="Q6_K"),
            dict(q_proj="Q5_K", v_proj="Q4_1", o_proj="Q5_1", gate_proj="Q4_0", up_proj="Q5_1", down_proj="Q4_K")]
    for i, (block, kinds) in enumerate(zip(model.blocks, plan)):
        new = {}
        for proj, kind in kinds.items():
            old = getattr(block, proj)
            raw = RANDOM_BLOCKS[kind](old.out_features, old.in_features, seed=i * 10 + len(proj))
            bias = old.bias32 if old.bias32.numel() else None
            new[proj] = _layer_class(kind).from_blocks(raw, bias, None, torch.bfloat16, kind)
        for proj, layer in new.items():
            setattr(block, proj, layer)
        _join(block, ("q_proj", "k_proj", "v_proj"), "qkv", new)
        _join(block, ("gate_proj", "up_proj"), "gate_up", new)
    if head == "block":
        raw = random_q6k(64, 256, seed=7)
        model.lm_head = _layer_class("Q6_K").from_blocks(raw, None, None, torch.bfloat16, "Q6_K")
    model.quant = "gguf"
    return model


@pytest.mark.parametrize("head", ["block", "int4", "dense", "tied"])
def test_any_mix_of_int4_and_block_layers_is_read_back_bit_identical(tmp_path, head):
    from torch import nn

    from speculant.backends.native_gguf_store import load_gguf_store, save_gguf_store, storable

    model = mixed(head)
    assert model.blocks[0].qkv.bias32.numel() and model.blocks[1].qkv is None  # biases; a block not joined
    report = {"q4_k": 3, "kept": {"F16": 1}, "mismatched": ["x: no"]}
    path = tmp_path / "m.safetensors"
    save_gguf_store(model, path, "x86", 64, head in ("block", "int4"), report)
    loaded, got_report = load_gguf_store(path, model.config, None, torch.bfloat16)
    assert got_report == report and layout(loaded) == layout(model)
    assert type(loaded.lm_head) is type(model.lm_head)
    if head == "tied":
        assert loaded.lm_head.weight.data_ptr() == loaded.embed.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(passes(model), passes(loaded)))
    assert not [f for f in tmp_path.iterdir() if f != path]  # no temporary file left

    model.blocks[1].o_proj = nn.Linear(256, 256, bias=False).bfloat16()  # a layer the file does not hold
    assert not storable(model)
    with pytest.raises(ValueError, match="int4 layers of speculant's layout and GGUF block layers only"):
        save_gguf_store(model, tmp_path / "other.safetensors", "x86", 64, False, report)


def test_a_gguf_target_runs_its_own_blocks_by_default(tmp_path, monkeypatch):
    """"auto" takes the file's own blocks for a model that comes from a GGUF file (the file, or its
    conversion in the cache), int4 for a transformers directory and for adapted weights (a LoRA
    adapter merged: no longer the file's), and a model already loaded keeps how it was loaded."""
    from speculant import SpeculativeDecoder
    from speculant.config import DecoderConfig
    from speculant.defaults import choose_runtime
    from speculant.errors import ConfigError
    from speculant.store.loading import load_native
    from speculant.store.models import has_gguf_source, resolve

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    g = write_gguf(tmp_path / "tiny.gguf")
    rt = choose_runtime(str(g), "bfloat16")
    assert (rt.backend, rt.target_quant, rt.quant_head) == ("native", "gguf", True) and "own blocks" in rt.why
    converted = resolve(str(g), "bfloat16")  # the cache directory it was converted to
    assert has_gguf_source(converted) and choose_runtime(str(converted), "bfloat16").target_quant == "gguf"
    assert choose_runtime(str(g), "bfloat16", adapted=True).target_quant == "int4"
    assert choose_runtime(str(g), "bfloat16", target_quant="int4").target_quant == "int4"  # the opt-in
    plain = tmp_path / "hf"
    tiny_qwen2(seed=0, hidden=128, dtype=torch.bfloat16).save_pretrained(plain)
    assert not has_gguf_source(plain) and choose_runtime(str(plain), "bfloat16").target_quant == "int4"
    assert not has_gguf_source(tmp_path / "missing.gguf") and not has_gguf_source(tmp_path)
    with pytest.raises(ConfigError, match="do not hold a LoRA adapter's changes"):
        DecoderConfig(target=str(g), target_quant="gguf", lora=str(tmp_path))
    loaded = load_native(str(g), "bfloat16", "gguf", quant_head=True)
    dec = SpeculativeDecoder(loaded, method="ar")  # auto: the loaded model's own quantization, not int4
    assert dec.config.target_quant == "gguf" and dec.target.model is loaded.model
    assert len(dec.generate([1, 5, 9], 4).token_ids) == 4
