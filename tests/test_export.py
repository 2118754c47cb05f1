"""export-heads: Medusa heads written for the Medusa reference code and for vLLM, read back by
independent readers written from those projects' documented parameter names and shapes (not
speculant's loader), whose head outputs must equal speculant's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from speculant.errors import ConfigError
from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads, save_heads
from speculant.heads.export import export_heads

from tiny import tiny_llama, tiny_model_dir

H, V, K, N = 48, 64, 3, 2


class _Res(nn.Module):
    """Medusa's ResBlock: x + SiLU(linear(x)), parameter ``linear``."""

    def __init__(self, h):
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x):
        return x + F.silu(self.linear(x))


def read_medusa(directory):
    """The Medusa reference code's heads: ``medusa_head = ModuleList([Sequential(*[ResBlock] * n,
    Linear(H, V, bias=False))] * K)`` loaded strictly from medusa_lm_head.safetensors."""
    cfg = json.loads((directory / "config.json").read_text())
    K_, n = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    state = load_file(directory / "medusa_lm_head.safetensors")
    h, v = state["0.0.linear.weight"].shape[1], state[f"0.{n}.weight"].shape[0]
    heads = nn.ModuleList([nn.Sequential(*[_Res(h) for _ in range(n)], nn.Linear(h, v, bias=False)) for _ in range(K_)])
    heads.load_state_dict({k: t.float() for k, t in state.items()}, strict=True)
    return lambda x: torch.stack([head(x) for head in heads]), cfg


class _VllmBlock(nn.Module):
    """vLLM's Medusa ResidualBlock: ``layers`` of Linear(H, H, bias=medusa_fc_bias), x + SiLU(layer(x))."""

    def __init__(self, h, n, bias):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(h, h, bias=bias) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


def read_vllm(directory):
    """vLLM's ``Medusa`` draft model: ``blocks.{k}.layers.{j}``, ``lm_heads.{k}`` (one shared
    ``lm_heads.0`` when ``original_lm_head``), sizes from config.json, every tensor used."""
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    state = load_file(directory / "model.safetensors")
    h, v, k_, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_hidden_layers"]
    blocks = nn.ModuleList([_VllmBlock(h, n, cfg.get("medusa_fc_bias", False)) for _ in range(k_)])
    lm = nn.ModuleList([nn.Linear(h, v, bias=False) for _ in range(1 if cfg.get("original_lm_head") else k_)])
    model = nn.ModuleDict({"blocks": blocks, "lm_heads": lm})
    model.load_state_dict({k: t.float() for k, t in state.items()}, strict=True)
    return lambda x: torch.stack([lm[0 if len(lm) == 1 else k](blocks[k](x)) for k in range(k_)]), cfg


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0).eval()


def _heads(target, shared):
    g = torch.Generator().manual_seed(1)
    heads = MedusaHeads(HeadsConfig(K, N, H, V, shared_lm_head=shared), target.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return heads.eval()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-projection", "own-projections"])
@pytest.mark.parametrize("fmt, reader", [("medusa", read_medusa), ("vllm", read_vllm)])
def test_exported_heads_give_speculants_outputs(target, tmp_path, shared, fmt, reader):
    heads = _heads(target, shared)
    x = torch.randn(5, H)
    want = heads(x).float()  # (K, 5, V)
    out = export_heads(heads, tmp_path / fmt, fmt, base_model="/models/target", dtype=torch.float32)
    run, cfg = reader(out)
    torch.testing.assert_close(run(x), want, atol=1e-5, rtol=1e-5)
    assert cfg["base_model_name_or_path"] == "/models/target"
    if fmt == "vllm":
        assert cfg["original_lm_head"] is shared
    # bf16, what the engines run: the same up to bf16 rounding of the weights
    run16, _ = reader(export_heads(heads, tmp_path / f"{fmt}-bf16", fmt, base_model="x"))
    assert (run16(x) - want).abs().max() < 0.05 * want.abs().max()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("shared", [True, False], ids=["shared-projection", "own-projections"])
def test_medusa_llm_loads_the_export(tmp_path, shared):
    """medusa-llm 0.1 (the Medusa reference code on PyPI) builds its own heads over a target
    (``MedusaModel(...).medusa_head``): the export loads into them strictly, and medusa-llm's own
    forward (target, then heads) gives speculant's head outputs. One residual block per head only:
    medusa-llm 0.1 repeats ONE ResBlock module for ``medusa_num_layers`` > 1, so it cannot hold
    distinct blocks. Its ``from_pretrained`` cannot run with transformers 5 (docs/heads.md)."""
    medusa = pytest.importorskip("medusa.model.medusa_model", reason="medusa-llm is not installed: "
                                 "pip install -e '.[medusa]' runs this test against the Medusa reference code")
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(tmp_path / "target", seed=0)  # medusa-llm reads the target's tokenizer
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    g = torch.Generator().manual_seed(2)
    heads = MedusaHeads(HeadsConfig(K, 1, H, V, shared_lm_head=shared), lm.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    out = export_heads(heads.eval(), tmp_path / "medusa", "medusa", base_model=str(model_dir), dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    theirs = medusa.MedusaModel(lm, cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["base_model_name_or_path"])
    theirs.medusa_head.load_state_dict(load_file(str(out / "medusa_lm_head.safetensors")), strict=True)
    ids = torch.tensor([[5, 9, 17, 3, 40, 22]])
    got = theirs(input_ids=ids)  # (K, 1, T, V): medusa-llm's target pass and heads
    with torch.no_grad():
        want = heads(lm.model(ids).last_hidden_state[0])
    assert got.shape == (K, 1, 6, V)
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-5)
    two = medusa.MedusaModel(lm, K, 2, str(model_dir))
    assert two.medusa_head[0][0] is two.medusa_head[0][1]  # why only one block per head loads faithfully


def test_export_refuses_sequential_heads_and_a_used_directory(target, tmp_path):
    seq = SequentialHeads(HeadsConfig(K, 1, H, V, kind="sequential"), target.get_output_embeddings(),
                          target.get_input_embeddings())
    with pytest.raises(ConfigError, match="only Medusa heads"):
        export_heads(seq, tmp_path / "s", "vllm", base_model="x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_heads(_heads(target, True), tmp_path / "used", "medusa", base_model="x")
    with pytest.raises(ConfigError, match="unknown export format"):
        export_heads(_heads(target, True), tmp_path / "f", "tgi", base_model="x")


def test_cli_export_heads(tmp_path, capsys):
    from speculant import SpeculativeDecoder
    from speculant.cli.commands import main

    model_dir = tiny_model_dir(tmp_path / "target", seed=0)
    lm = SpeculativeDecoder(str(model_dir), method="ar", dtype="float32").target.model
    heads = _heads(lm, True)
    save_heads(heads, tmp_path / "heads")
    assert main(["export-heads", "--target", str(model_dir), "--heads", str(tmp_path / "heads"), "--format", "vllm",
                 "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["heads"] == K and info["vocab_size"] == V
    run, cfg = read_vllm(tmp_path / "out")
    x = torch.randn(2, H)
    torch.testing.assert_close(run(x), heads(x).float(), atol=1e-5, rtol=1e-5)
    assert cfg["base_model_name_or_path"] == info["base_model"]
