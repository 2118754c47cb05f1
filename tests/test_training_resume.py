"""Resuming head training from damaged checkpoints: a truncated file in the newest checkpoint is
named and skipped, the run resumes from the one before and ends where an uninterrupted run does;
when no checkpoint can be read, a clear error names them all. (A run killed in the middle of a
checkpoint write, on two processes: test_training_distributed.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from speculant.errors import ConfigError
from speculant.heads import HeadsConfig
from speculant.training.train import train_heads

from tiny import tiny_llama

V, H, K = 64, 64, 3
PATTERN = [5, 17, 9, 33, 2, 41, 12, 27, 50, 8, 19]
KW = dict(steps=12, save_every=4, batch_size=4, seq_len=64, lr_heads=1e-2, held_out_fraction=0.25, progress=False,
          seed=0, rows_per_batch=64)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=V, hidden=H, scale=4.0).requires_grad_(False)


@pytest.fixture
def data(tmp_path):
    recs = [{"prompt": f"r{i}", "prompt_len": 4, "ids": [PATTERN[(i + j) % len(PATTERN)] for j in range(44)]}
            for i in range(12)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def cfg() -> HeadsConfig:
    return HeadsConfig(num_heads=K, num_layers=1, hidden_size=H, vocab_size=V, shared_lm_head=True,
                       base_model="tiny-llama")


def truncate(path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


@pytest.mark.parametrize("damaged", ["heads/model.safetensors", "state.pt"])
def test_a_truncated_newest_checkpoint_is_named_and_skipped(target, data, tmp_path, capsys, damaged):
    whole = train_heads(target, cfg(), data, tmp_path / "a", **KW)
    first = train_heads(target, cfg(), data, tmp_path / "b", stop_after=8, **KW)
    ckpts = tmp_path / "b" / "checkpoints"
    assert first["step"] == 8 and sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000008"]
    truncate(ckpts / "step-00000008" / damaged)
    capsys.readouterr()
    second = train_heads(target, cfg(), data, tmp_path / "b", **KW)
    err = capsys.readouterr().err
    assert (f"speculant: skipping checkpoint {ckpts / 'step-00000008'}: it cannot be read ({damaged} is truncated "
            "or damaged: ") in err
    assert f"speculant: resuming from {ckpts / 'step-00000004'} (step 4 of 12)" in err
    assert second["resumed_from"] == 4 and second["step"] == 12
    assert second["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_no_readable_checkpoint_is_a_clear_error(target, data, tmp_path):
    train_heads(target, cfg(), data, tmp_path / "b", stop_after=8, **KW)
    ckpts = tmp_path / "b" / "checkpoints"
    truncate(ckpts / "step-00000008" / "state.pt")
    truncate(ckpts / "step-00000004" / "heads" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be read: step-00000008 \(state.pt is truncated "
                                          r"or damaged: .*\); step-00000004 \(heads/model.safetensors is truncated "
                                          r"or damaged: .*\)\. Move them away .* --no-resume"):
        train_heads(target, cfg(), data, tmp_path / "b", **KW)
    again = train_heads(target, cfg(), data, tmp_path / "b", **{**KW, "resume": False})  # the way out it names
    assert again["resumed_from"] is None and again["step"] == 12


def test_feature_noise_is_the_same_after_a_resume(target, data, tmp_path):
    """The noise of micro-batch m is seeded by (seed, m, process), not drawn from the global
    generator, so a run stopped and resumed adds the noise an uninterrupted run adds."""
    kw = {**KW, "feature_noise": 0.5}
    train_heads(target, cfg(), data, tmp_path / "a", **kw)
    train_heads(target, cfg(), data, tmp_path / "b", stop_after=6, **kw)
    resumed = train_heads(target, cfg(), data, tmp_path / "b", **kw)
    assert resumed["resumed_from"] == 6
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    train_heads(target, cfg(), data, tmp_path / "c", **KW)  # without the noise: other weights
    assert not torch.allclose(load_file(str(tmp_path / "c" / "model.safetensors"))["0.0.linear.weight"],
                              a["0.0.linear.weight"])
