"""export-eagle: EAGLE drafters written as the EAGLE-1 draft models of vLLM and SGLang, read back
by an independent reader written from those engines' loaders (not speculant's code), whose
features must equal speculant's.

What the reader follows (vLLM vllm/model_executor/models/llama_eagle.py ``EagleLlamaForCausalLM``
and llama.py ``LlamaDecoderLayer``; SGLang python/sglang/srt/models/llama_eagle.py
``LlamaForCausalLMEagle`` and llama.py; EAGLE eagle/model/cnets.py):

- the input is ``fc(cat((embed_tokens(x_{i+1}), h_i), dim=-1))``: embedding first, then the
  target's hidden state, at position i (vLLM's proposer shifts the tokens, not the positions);
- vLLM's ``fc`` is ``Linear(2H, H, bias=False)``, SGLang's ``Linear(2H, H)`` (with bias);
- the layer: no input_layernorm, causal self-attention with rotate-half RoPE (``rope_theta``),
  grouped KV heads, q/k/v biases when ``qkv_bias`` (vLLM) or else ``attention_bias`` / ``bias``,
  o_proj bias when ``attention_bias`` / ``bias``; then ``a + MLP(RMSNorm(a))`` (SwiGLU), no final
  norm (the engines return ``hidden_states + residual``);
- embed_tokens and lm_head are the target's (absent from the checkpoint), and every tensor in
  the checkpoint must have a parameter (vLLM's AutoWeightsLoader raises on any other).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from speculant.eagle import EagleConfig, EagleModel
from speculant.eagle.checkpoint import save_eagle
from speculant.eagle.export import export_eagle
from speculant.errors import ConfigError

from tiny import tiny_llama, tiny_model_dir, tiny_qwen2

LAYER = ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
         "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
         "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"]
ARCHITECTURE = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


def _biases(fmt, cfg):
    """(q/k/v bias, o_proj bias, fc bias) as each engine decides them from the config."""
    attention = bool(cfg.get("attention_bias") or cfg.get("bias"))
    if fmt == "vllm":
        return bool(cfg.get("qkv_bias", attention)), attention, False
    return attention, attention, True


def expected_shapes(fmt, cfg):
    """Every tensor the engine's drafter has a parameter for (names as in the checkpoint)."""
    H, F_, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    shapes = dict(zip(LAYER, [(q, H), (kv, H), (kv, H), (H, q), (F_, H), (F_, H), (H, F_), (H,)]))
    shapes["fc.weight"] = (H, 2 * H)
    qkv_bias, o_bias, fc_bias = _biases(fmt, cfg)
    if qkv_bias:
        shapes.update({"layers.0.self_attn.q_proj.bias": (q,), "layers.0.self_attn.k_proj.bias": (kv,),
                       "layers.0.self_attn.v_proj.bias": (kv,)})
    if o_bias:
        shapes["layers.0.self_attn.o_proj.bias"] = (H,)
    if fc_bias:
        shapes["fc.bias"] = (H,)
    return shapes


def read_export(directory, fmt, embed_first=True):
    """The engine's EAGLE-1 drafter from config.json + model.safetensors, as a function
    (embedding matrix (V, H), hidden (T, H), tokens (T,)) -> features (T, H), in float32."""
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE[fmt]] and cfg["num_hidden_layers"] == 1
    state = {k: t.float() for k, t in load_file(str(directory / "model.safetensors")).items()}
    assert {k: tuple(t.shape) for k, t in state.items()} == expected_shapes(fmt, cfg)
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    eps = cfg["rms_norm_eps"]

    def linear(x, name):
        return x @ state[f"{name}.weight"].T + state.get(f"{name}.bias", 0.0)

    def rope(x, positions):  # x (T, heads, D): rotate-half ("neox") RoPE
        inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = positions.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    def run(embed, hidden, tokens):
        T = tokens.shape[0]
        e = embed[tokens].float()
        u = linear(torch.cat((e, hidden) if embed_first else (hidden, e), dim=-1), "fc")
        pos = torch.arange(T)
        q = rope(linear(u, "layers.0.self_attn.q_proj").view(T, Hq, D), pos)
        k = rope(linear(u, "layers.0.self_attn.k_proj").view(T, Hkv, D), pos).repeat_interleave(Hq // Hkv, 1)
        v = linear(u, "layers.0.self_attn.v_proj").view(T, Hkv, D).repeat_interleave(Hq // Hkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, Hq * D)
        a = u + linear(o, "layers.0.self_attn.o_proj")
        n = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * state["layers.0.post_attention_layernorm.weight"]
        mlp = linear(F.silu(linear(n, "layers.0.mlp.gate_proj")) * linear(n, "layers.0.mlp.up_proj"),
                     "layers.0.mlp.down_proj")
        return a + mlp

    return run, cfg


TARGETS = {"llama": lambda: tiny_llama(0), "qwen2": lambda: tiny_qwen2(0)}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    return request.param, TARGETS[request.param]().eval()


def drafter(target, draft_vocab: int = 0, seed: int = 0, input_scale: bool = False) -> EagleModel:
    """A drafter with random weights (fc bias included; a random input scale with ``input_scale``)
    for the transformers model ``target``."""
    cfg = EagleConfig.for_target(target.config, intermediate_size=96, depth=5, draft_vocab=draft_vocab,
                                 input_scale=input_scale)
    model = EagleModel(cfg, target.get_output_embeddings(), target.get_input_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        if input_scale:
            model.input_scale.copy_(torch.rand(model.input_scale.shape, generator=g) * 4 + 0.1)
    if draft_vocab:
        model.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab])
    return model.eval()


def _inputs(target, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, V = target.config.hidden_size, target.config.vocab_size
    return torch.randn(T, H, generator=g), torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("input_scale", [False, True])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_the_engines_drafter_computes_speculants_features(target, tmp_path, fmt, input_scale):
    name, lm = target
    model = drafter(lm, input_scale=input_scale)
    assert model.fc.bias.abs().max() > 0.1  # a bias vLLM's fc cannot hold: the export folds it
    hidden, tokens = _inputs(lm)
    with torch.no_grad():
        want = model(hidden[None], tokens[None])[0]
    out = export_eagle(model, tmp_path / fmt, fmt, base_model="/models/target", dtype=torch.float32)
    run, cfg = read_export(out, fmt)
    embed = lm.get_input_embeddings().weight.detach()
    torch.testing.assert_close(run(embed, hidden, tokens), want, atol=1e-4, rtol=1e-4)
    # the reader tells the orders apart: [hidden ; embedding] is another function
    swapped, _ = read_export(out, fmt, embed_first=False)
    assert (swapped(embed, hidden, tokens) - want).abs().max() > 1e-2
    assert cfg["base_model_name_or_path"] == "/models/target" and cfg["vocab_size"] == lm.config.vocab_size
    assert cfg["max_position_embeddings"] > 0 and cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is (fmt == "vllm" or name == "qwen2")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    readme = (out / "README.md").read_text()
    assert ('"method": "eagle"' in readme) if fmt == "vllm" else ("--speculative-algorithm EAGLE" in readme)


def test_transformers_reads_the_config(target, tmp_path):
    from transformers import AutoConfig

    name, lm = target
    out = export_eagle(drafter(lm), tmp_path / "e", "vllm", dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(str(out))
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1 and cfg.attention_bias
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        lm.config.hidden_size, lm.config.num_attention_heads, lm.config.num_key_value_heads,
        lm.config.hidden_size // lm.config.num_attention_heads, lm.config.vocab_size)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == (1e6 if name == "qwen2" else 10000.0)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 0.005), (torch.bfloat16, 0.05)])
def test_half_precision_exports_match_up_to_rounding(target, tmp_path, dtype, tol):
    """The engines' dtypes: the same features up to the rounding of the weights (relative error
    of the whole feature matrix; the fold adds none beyond that of the unfolded sglang layout)."""
    _, lm = target
    model = drafter(lm)
    hidden, tokens = _inputs(lm)
    with torch.no_grad():
        want = model(hidden[None], tokens[None])[0]
    out = export_eagle(model, tmp_path / "h", "vllm", dtype=dtype)
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {dtype}
    run, cfg = read_export(out, "vllm")
    assert cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    got = run(lm.get_input_embeddings().weight.detach(), hidden, tokens)
    assert (got - want).norm() < tol * want.norm()


def test_draft_vocabulary_is_a_token_map_for_sglang_only(target, tmp_path):
    _, lm = target
    model = drafter(lm, draft_vocab=16)
    ids = model.draft_vocab.tolist()
    sg = export_eagle(model, tmp_path / "sglang", "sglang", dtype=torch.float32)
    hot = torch.load(sg / "token_map.pt", weights_only=True)  # as SGLang's load_token_map reads it
    assert torch.tensor(hot, dtype=torch.int64).tolist() == ids
    assert "--speculative-token-map" in (sg / "README.md").read_text()
    vl = export_eagle(model, tmp_path / "vllm", "vllm", dtype=torch.float32)
    assert sorted(p.name for p in vl.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "16 tokens" in (vl / "README.md").read_text()
    for out, fmt in ((sg, "sglang"), (vl, "vllm")):
        read_export(out, fmt)  # the exact parameter set: no draft_vocab tensor among them


def test_bad_inputs_are_refused_with_what_to_do(target, tmp_path):
    _, lm = target
    model = drafter(lm)
    with pytest.raises(ConfigError, match="EAGLE-3 export is not possible: this drafter reads one feature"):
        export_eagle(model, tmp_path / "e3", "eagle3")
    with pytest.raises(ConfigError, match="unknown export format 'medusa': choose vllm or sglang"):
        export_eagle(model, tmp_path / "m", "medusa")
    with pytest.raises(ConfigError, match="only an EAGLE drafter"):
        export_eagle(torch.nn.Linear(4, 4), tmp_path / "l", "vllm")
    with pytest.raises(ConfigError, match="unsupported dtype"):
        export_eagle(model, tmp_path / "d", "vllm", dtype=torch.int8)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_eagle(model, tmp_path / "used", "vllm")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 8, "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match="trained for another model"):
        export_eagle(model, tmp_path / "o", "vllm", base_model=str(other))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert {p.name for p in tmp_path.iterdir()} == {"used", "other"}  # nothing half-written


def test_cli_export_eagle(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from speculant.cli.commands import main

    target_dir = tiny_model_dir(tmp_path / "target", seed=0)
    lm = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    model = drafter(lm, draft_vocab=20)
    save_eagle(model, tmp_path / "drafter")
    assert main(["export-eagle", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"),
                 "--format", "sglang", "--dtype", "float32"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["base_model"] == str(target_dir) and info["depth"] == 5 and info["draft_vocab"] == 20
    run, cfg = read_export(tmp_path / "out", "sglang")
    assert cfg["base_model_name_or_path"] == str(target_dir)
    assert cfg["max_position_embeddings"] == 512  # the target's
    hidden, tokens = _inputs(lm)
    with torch.no_grad():
        want = model(hidden[None], tokens[None])[0]
    torch.testing.assert_close(run(lm.get_input_embeddings().weight.detach(), hidden, tokens), want,
                               atol=1e-4, rtol=1e-4)
    assert main(["export-eagle", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "v"),
                 "--format", "vllm"]) == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(["export-eagle", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "e3"),
                 "--format", "eagle3"]) == 2
    assert "EAGLE-3 export is not possible" in capsys.readouterr().err
    assert main(["export-eagle", "--drafter", str(tmp_path / "target"), "--out", str(tmp_path / "x"),
                 "--format", "vllm"]) == 2
    assert "no EAGLE drafter at" in capsys.readouterr().err
