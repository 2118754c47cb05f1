"""Draft vocabularies (speculant.training.vocab): ranked from a corpus's answers, and cut short on
a trained drafter (``speculant cut-vocab``) without touching its weights; a cut drafter proposes
only its kept tokens and still decodes as plain decoding; bad requests are clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from speculant.errors import ConfigError, ModelLoadError
from speculant.training.vocab import cut_draft_vocab, draft_vocabulary

V = 64


def _records(counts: dict[int, int]) -> list[dict]:
    """One record whose answer holds each token ``t`` ``counts[t]`` times (prompt: token 1)."""
    answer = [t for t, c in counts.items() for _ in range(c)]
    return [{"ids": [1] + answer, "prompt_len": 1}]


def test_draft_vocabulary_ranks_by_frequency_within_a_set():
    recs = _records({7: 5, 9: 4, 30: 3, 2: 2, 50: 1})
    assert draft_vocabulary(recs, 3, V).tolist() == [7, 9, 30]
    # within {2, 9, 30, 40, 41}: 9, 30, 2 by frequency, then the lowest unused ids of the set
    assert draft_vocabulary(recs, 3, V, within=[2, 9, 30, 40, 41]).tolist() == [2, 9, 30]
    assert draft_vocabulary(recs, 5, V, within=[2, 9, 30, 40, 41]).tolist() == [2, 9, 30, 40, 41]
    assert draft_vocabulary(recs, 4, V, within=[7, 9, 40, 41]).tolist() == [7, 9, 40, 41]
    with pytest.raises(ConfigError, match="6 tokens cannot be drawn from 5"):
        draft_vocabulary(recs, 6, V, within=[2, 9, 30, 40, 41])


def _eagle_dir(tmp_path, target_dir):
    from transformers import AutoModelForCausalLM

    from speculant.eagle import EagleConfig, EagleModel
    from speculant.eagle.checkpoint import save_eagle

    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = EagleConfig.for_target(hf.config, intermediate_size=96, depth=4, draft_vocab=48)
    model = EagleModel(cfg, hf.get_output_embeddings(), hf.get_input_embeddings())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.set_draft_vocab(torch.arange(8, 56))
    return save_eagle(model.eval(), tmp_path / "eagle")


def test_a_cut_eagle_drafter_keeps_its_weights_proposes_fewer_tokens_and_stays_lossless(tmp_path):
    from speculant.api import SpeculativeDecoder
    from speculant.tuning.costmodel import PassCost
    from tiny import tiny_model_dir

    target_dir = tiny_model_dir(tmp_path / "target")
    src = _eagle_dir(tmp_path, target_dir)
    (src / "training_report.json").write_text("{}")
    (src / "model-step10.safetensors").write_bytes(b"not copied")
    # frequent tokens 3 and 60 lie outside the drafter's vocabulary (8..55): never added
    recs = _records({3: 9, 60: 9, 20: 6, 11: 5, 40: 4, 9: 3})
    out = cut_draft_vocab(src, recs, 16, tmp_path / "cut")  # the default tree ranks 16 candidates
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training_report.json"]
    assert json.loads((out / "config.json").read_text())["speculant_eagle"]["draft_vocab"] == 16
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    kept = [20, 11, 40, 9] + [8, 10] + list(range(12, 20)) + [21, 22]  # by frequency, then the lowest ids
    assert after["draft_vocab"].tolist() == sorted(kept)
    assert all(torch.equal(before[k], after[k]) for k in before if k != "draft_vocab")

    flat = PassCost((1, 64), (100.0, 100.0))
    plain = SpeculativeDecoder(target_dir, method="ar", dtype="float32").generate("w1 w2 w3 w1 w2", 20)
    dec = SpeculativeDecoder(target_dir, method="eagle", heads=out, dtype="float32", tree_budget=flat)
    proposals = dec.heads.draft_topk(torch.randn(32, dec.heads.config.hidden_size), 4)
    assert set(proposals.flatten().tolist()) <= set(kept)
    assert dec.generate("w1 w2 w3 w1 w2", 20).token_ids == plain.token_ids

    half = cut_draft_vocab(src, recs, 16, tmp_path / "cut-bf16", dtype=torch.bfloat16)  # the shipped form
    stored = load_file(str(half / "model.safetensors"))
    assert stored["draft_vocab"].dtype == torch.long and torch.equal(stored["draft_vocab"], after["draft_vocab"])
    assert all(torch.equal(stored[k], before[k].to(torch.bfloat16)) for k in before if k != "draft_vocab")
    dec = SpeculativeDecoder(target_dir, method="eagle", heads=half, dtype="float32", tree_budget=flat)
    assert dec.generate("w1 w2 w3 w1 w2", 20).token_ids == plain.token_ids


def test_sequential_heads_are_cut_with_their_tree(tmp_path):
    from speculant.heads import HeadsConfig, SequentialHeads, load_heads, save_heads
    from tiny import tiny_llama

    target = tiny_llama(0)
    H = target.config.hidden_size
    cfg = HeadsConfig(3, 1, H, V, base_model="tiny-llama", kind="sequential", draft_vocab=16)
    heads = SequentialHeads(cfg, target.get_output_embeddings(), target.get_input_embeddings())
    heads.set_draft_vocab(torch.arange(16))
    save_heads(heads, tmp_path / "heads")
    (tmp_path / "heads" / "tree.json").write_text("[[0], [1]]")
    out = cut_draft_vocab(tmp_path / "heads", _records({5: 3, 30: 9, 2: 1}), 4, tmp_path / "cut")
    assert (out / "tree.json").read_text() == "[[0], [1]]"
    loaded = load_heads(out, target)
    assert loaded.config.draft_vocab == 4 and loaded.draft_vocab.tolist() == [0, 1, 2, 5]


def test_cutting_refuses_what_it_cannot_do(tmp_path):
    from speculant.heads import HeadsConfig, MedusaHeads, save_heads
    from tiny import tiny_llama, tiny_model_dir

    target_dir = tiny_model_dir(tmp_path / "target")
    src = _eagle_dir(tmp_path, target_dir)
    recs = _records({20: 2})
    with pytest.raises(ConfigError, match="1 to 48 tokens"):
        cut_draft_vocab(src, recs, 49, tmp_path / "a")
    with pytest.raises(ConfigError, match="1 to 48 tokens"):
        cut_draft_vocab(src, recs, 0, tmp_path / "a")
    with pytest.raises(ConfigError, match="must be a new directory"):
        cut_draft_vocab(src, recs, 8, src)
    with pytest.raises(ModelLoadError, match="no drafter at"):
        cut_draft_vocab(tmp_path / "nothing", recs, 8, tmp_path / "a")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 12)
    with pytest.raises(ModelLoadError, match="model.safetensors is corrupt"):
        cut_draft_vocab(broken, recs, 8, tmp_path / "a")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is corrupt"):
        cut_draft_vocab(broken, recs, 8, tmp_path / "a")
    target = tiny_llama(0)
    medusa = MedusaHeads(HeadsConfig(2, 1, target.config.hidden_size, V), target.get_output_embeddings())
    save_heads(medusa, tmp_path / "medusa")
    with pytest.raises(ModelLoadError, match="not a drafter with a draft vocabulary"):
        cut_draft_vocab(tmp_path / "medusa", recs, 8, tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing half-written


def test_the_cli_cuts_counting_only_the_training_records(tmp_path, capsys):
    from speculant.cli.commands import main
    from speculant.training.eagle_train import split_records
    from tiny import tiny_model_dir

    target_dir = tiny_model_dir(tmp_path / "target")
    src = _eagle_dir(tmp_path, target_dir)
    # 4 records; held out (split_records(4, 1)): the one whose answer is token 50 x 20
    records = [{"ids": [1] + [t] * c, "prompt_len": 1} for t, c in ((12, 3), (13, 2), (50, 20), (14, 1))]
    held, _, _ = split_records(len(records), 1)
    assert held == [2]
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["cut-vocab", "--drafter", str(src), "--data", str(data), "--size", "3", "--held-out", "1",
                 "--out", str(tmp_path / "cut")]) == 0
    assert json.loads(capsys.readouterr().out)["records_counted"] == 3
    assert load_file(str(tmp_path / "cut" / "model.safetensors"))["draft_vocab"].tolist() == [12, 13, 14]
