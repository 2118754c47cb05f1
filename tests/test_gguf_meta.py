"""speculant.store.gguf_meta: a Gemma 2 GGUF's soft caps and query scale, and a Gemma 3 GGUF's query
scale and RoPE scaling, reach the converted config.

transformers' GGUF loader does not read them (its Gemma2Config keeps caps 50 / 30 and
query_pre_attn_scalar 256), so the tiny GGUFs here use other values throughout: caps 40 / 20, a
head dimension (8) that is neither 256 nor hidden_size / num_attention_heads (16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from speculant.store import gguf_meta
from speculant.store import models

HIDDEN, HEADS, HEAD_DIM = 32, 2, 8


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))


def _write_gemma2_gguf(path: Path, layers: int = 2, caps: tuple[float, float] | None = (40.0, 20.0),
                       tensors: bool = True, arch: str = "gemma2", rope_scale: float | None = None) -> Path:
    """A float32 Gemma 2 GGUF with random weights (``tensors=False``: metadata only, enough for
    ``config_fixes`` but not for a conversion)."""
    import gguf

    vocab_size, ffn = 64, 64
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gemma2")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    if rope_scale is not None:
        w.add_rope_freq_base(1e6)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scale)
    if caps is not None:
        w.add_attn_logit_softcapping(caps[0])
        w.add_final_logit_softcapping(caps[1])
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"t{i}" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([3, 3, 3, 2] + [1] * (vocab_size - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    rng = np.random.default_rng(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    if tensors:
        rand("token_embd.weight", vocab_size, HIDDEN)
        for i in range(layers):
            for name in ("attn_q", "attn_k", "attn_v"):
                rand(f"blk.{i}.{name}.weight", HEADS * HEAD_DIM, HIDDEN)
            rand(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
            rand(f"blk.{i}.ffn_gate.weight", ffn, HIDDEN)
            rand(f"blk.{i}.ffn_up.weight", ffn, HIDDEN)
            rand(f"blk.{i}.ffn_down.weight", HIDDEN, ffn)
            for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def test_gemma2_conversion_takes_the_caps_and_query_scale_of_its_gguf(tmp_path):
    g = _write_gemma2_gguf(tmp_path / "tiny-gemma2.gguf")
    target = models.resolve(str(g), torch.float32)
    cfg = _config(target)
    assert cfg["model_type"] == "gemma2"
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (40.0, 20.0)
    assert cfg["query_pre_attn_scalar"] == HEAD_DIM  # not Gemma2Config's 256
    assert json.loads((target / models.COMPLETE_MARKER).read_text())["config_fixes"] == gguf_meta.VERSION
    from speculant.store.loading import load_native

    lm = load_native(str(g), "float32")  # warm: the native runtime runs the GGUF's caps and scale
    assert lm.path == target
    arch = lm.model.arch
    assert (arch.attn_softcap, arch.final_softcap, arch.attn_scale) == (40.0, 20.0, HEAD_DIM ** -0.5)


def test_query_scale_follows_llama_cpp_rule_and_absent_caps_keep_the_defaults(tmp_path):
    # the 27B (46 layers): n_embd / n_head; every other size: the head dimension
    big = _write_gemma2_gguf(tmp_path / "g27.gguf", layers=46, caps=None, tensors=False)
    assert gguf_meta.config_fixes(big) == {"query_pre_attn_scalar": HIDDEN // HEADS}
    small = _write_gemma2_gguf(tmp_path / "g2.gguf", layers=26, tensors=False)
    assert gguf_meta.config_fixes(small) == {"attn_logit_softcapping": 40.0, "final_logit_softcapping": 20.0,
                                             "query_pre_attn_scalar": HEAD_DIM}
    # another architecture: nothing to fix
    other = _write_gemma2_gguf(tmp_path / "l.gguf", tensors=False, arch="llama")
    assert gguf_meta.config_fixes(other) == {}


def test_gemma3_fixes(tmp_path):
    # Gemma 3: no caps to read; the 27B is 62 layers; linear RoPE scaling of the global layers
    small = _write_gemma2_gguf(tmp_path / "g3-1b.gguf", layers=26, tensors=False, arch="gemma3")
    assert gguf_meta.config_fixes(small) == {"query_pre_attn_scalar": HEAD_DIM}
    big = _write_gemma2_gguf(tmp_path / "g3-27b.gguf", layers=62, tensors=False, arch="gemma3", rope_scale=8.0)
    assert gguf_meta.config_fixes(big) == {
        "query_pre_attn_scalar": HIDDEN // HEADS,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    unscaled = _write_gemma2_gguf(tmp_path / "g3-4b.gguf", layers=34, tensors=False, arch="gemma3", rope_scale=1.0)
    assert "rope_parameters" not in gguf_meta.config_fixes(unscaled)
    from transformers import Gemma3TextConfig  # the fixes make a config transformers (and the runtime) read

    cfg = Gemma3TextConfig(num_hidden_layers=62)
    gguf_meta.apply(cfg, big)
    assert cfg.query_pre_attn_scalar == HIDDEN // HEADS and cfg.rope_parameters["full_attention"]["factor"] == 8.0


def test_a_gemma2_conversion_made_before_the_fix_is_converted_again(tmp_path, capsys):
    g = _write_gemma2_gguf(tmp_path / "tiny-gemma2.gguf")
    target = models.resolve(str(g), torch.float32)
    # as an earlier speculant left it: Gemma2Config's defaults, no config_fixes in the marker
    cfg = {**_config(target), "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
           "query_pre_attn_scalar": 256}
    (target / "config.json").write_text(json.dumps(cfg))
    marker = target / models.COMPLETE_MARKER
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items()
                                  if k != "config_fixes"}))
    capsys.readouterr()
    assert models.resolve(str(g), torch.float32) == target
    err = capsys.readouterr().err
    assert f"the converted model {target} was converted before" in err and "converting tiny-gemma2.gguf" in err
    cfg = _config(target)
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"], cfg["query_pre_attn_scalar"]) == \
        (40.0, 20.0, HEAD_DIM)
    # current now: the next resolve converts nothing
    capsys.readouterr()
    assert models.resolve(str(g), torch.float32) == target
    assert "converting" not in capsys.readouterr().err


def test_an_entry_of_another_architecture_without_config_fixes_is_kept(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (target / models.COMPLETE_MARKER).write_text(json.dumps({"dtype": "float32"}))
    assert gguf_meta.outdated(target / models.COMPLETE_MARKER) is None
    (target / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    assert "was converted before" in gguf_meta.outdated(target / models.COMPLETE_MARKER)
    (target / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert "was converted before" in gguf_meta.outdated(target / models.COMPLETE_MARKER)
