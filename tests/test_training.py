"""Head training: losses on hand-built logits (exact alignment), the Medusa-1 / Medusa-2 loops on a
tiny Llama (learning, checkpoint + resume, LoRA leaves the target untouched), calibration
accuracies + greedy tree, and the self-distillation data (prompt builders, resumable distill)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from speculant.errors import ConfigError
from speculant.heads import HeadsConfig, load_heads
from speculant.training.accuracy import build_tree, head_topk_accuracy
from speculant.training.data import distill, load_records, mixed_prompts, stdlib_prompts, wmt_prompts
from speculant.training.losses import combined_loss, head_valid_counts, lm_loss, medusa_loss
from speculant.training.train import train_heads
from speculant.trees.buffers import normalize_paths

from tiny import tiny_llama, tiny_model_dir

V, H, K = 64, 64, 3
PATTERN = [5, 17, 9, 33, 2, 41, 12, 27, 50, 8, 19]  # period 11: token t+2 is a function of the context


# ------------------------------------------------------------------------------------------ losses

def onehot_logits(tokens: torch.Tensor, K: int, V: int, shift: int, big: float = 20.0) -> torch.Tensor:
    """(K, B, T, V) logits whose head k at position t puts ``big`` on tokens[t + k + shift]."""
    B, T = tokens.shape
    logits = torch.zeros(K, B, T, V)
    for k in range(K):
        for t in range(T):
            j = t + k + shift
            if j < T:
                logits[k, :, t].scatter_(-1, tokens[:, j:j + 1], big)
    return logits


def test_medusa_loss_alignment_is_t_plus_k_plus_2():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    right = onehot_logits(tokens, 3, 16, shift=2)
    loss, per, top1, top5 = medusa_loss(right, tokens, mask, lam=0.8)
    assert top1.tolist() == [1.0, 1.0, 1.0] and top5.tolist() == [1.0, 1.0, 1.0]
    ce = -F.log_softmax(torch.tensor([20.0] + [0.0] * 15), -1)[0]  # the same CE for every pair
    torch.testing.assert_close(per, ce.repeat(3))
    torch.testing.assert_close(loss, ce * (1 + 0.8 + 0.64))
    # one position off (the lm_head's t+1, or t+k+3) is wrong everywhere the tokens differ
    for shift in (1, 3):
        _, _, top1_off, _ = medusa_loss(onehot_logits(tokens, 3, 16, shift), tokens, mask)
        assert bool((top1_off < 1).all())


def test_medusa_loss_mask_range_and_weights():
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    logits = torch.randn(3, 1, 6, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True, True, True, True, False, True]])  # token 4 is no target
    loss, per, _, _ = medusa_loss(logits, tokens, mask, lam=0.5)
    for k in range(3):  # reference: the counted (t, target) pairs, by hand
        pairs = [(t, t + k + 2) for t in range(6) if t + k + 2 < 6 and mask[0, t + k + 2]]
        ref = torch.stack([F.cross_entropy(logits[k, 0, t], tokens[0, j]) for t, j in pairs]).mean()
        torch.testing.assert_close(per[k], ref)
    torch.testing.assert_close(loss, per[0] + 0.5 * per[1] + 0.25 * per[2])
    assert head_valid_counts(mask, 3).tolist() == [3, 2, 1]
    # garbage at the masked target's positions changes nothing
    bad = logits.clone()
    bad[0, 0, 2], bad[1, 0, 1], bad[2, 0, 0] = 1e4, 1e4, 1e4  # the pairs whose target is token 4
    torch.testing.assert_close(medusa_loss(bad, tokens, mask, lam=0.5)[0], loss)
    # out of range: with T = 3 only head 0 has a pair
    l3, per3, t1, _ = medusa_loss(logits[:, :, :3], tokens[:, :3], mask[:, :3])
    assert per3[1:].tolist() == [0.0, 0.0] and t1[1:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(l3, per3[0])


def test_combined_loss_is_lm_plus_weighted_heads():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 8, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.bool)
    lm = torch.randn(2, 7, 8, generator=g)
    heads = torch.randn(2, 2, 7, 8, generator=g)
    ref_lm = F.cross_entropy(lm[:, :-1].reshape(-1, 8), tokens[:, 1:].reshape(-1))  # t predicts t+1
    torch.testing.assert_close(lm_loss(lm, tokens, mask), ref_lm)
    loss, lm_part, heads_part, *_ = combined_loss(lm, heads, tokens, mask, lam=0.8, heads_weight=0.3)
    torch.testing.assert_close(loss, ref_lm + 0.3 * medusa_loss(heads, tokens, mask, 0.8)[0])
    torch.testing.assert_close(lm_part, ref_lm)


# ------------------------------------------------------------------------------------------ training

def synthetic_records(n: int = 12, length: int = 44) -> list[dict]:
    """The same periodic text at different phases: a 4-token 'prompt', the rest the 'answer'."""
    return [{"prompt": f"r{i}", "prompt_len": 4, "ids": [PATTERN[(i + j) % len(PATTERN)] for j in range(length)]}
            for i in range(n)]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def heads_cfg(num_layers: int = 1) -> HeadsConfig:
    return HeadsConfig(num_heads=K, num_layers=num_layers, hidden_size=H, vocab_size=V, shared_lm_head=True,
                       base_model="tiny-llama")


FAST = dict(batch_size=4, seq_len=64, lr_heads=1e-2, held_out_fraction=0.25, progress=False, seed=0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=V, hidden=H, scale=4.0).requires_grad_(False)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("m1")
    data = write_jsonl(d / "data.jsonl", synthetic_records())
    report = train_heads(target, heads_cfg(), data, d / "heads", steps=40, save_every=100, **FAST)
    return d, report


def test_medusa1_learns(target, trained):
    d, report = trained
    init, final = report["initial"], report["final"]
    assert report["step"] == 40 and report["finished"]
    assert final["loss"] < 0.7 * init["loss"]
    assert final["top1"][0] > init["top1"][0] + 0.3
    assert len(load_records(d / "heads" / "held_out.jsonl")) == 3  # 25% of 12 records, for build_tree
    saved = json.loads((d / "heads" / "training_report.json").read_text())
    assert saved["final"] == final
    heads = load_heads(d / "heads", target)  # Medusa layout, loads against the frozen target
    assert heads.num_heads == K and (d / "heads" / "checkpoints" / "step-00000040" / "state.pt").is_file()


def test_checkpoint_resume_matches_uninterrupted_run(target, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    kw = dict(steps=12, save_every=4, lr_warmup_steps=3, **FAST)
    train_heads(target, heads_cfg(), data, tmp_path / "a", **kw)
    first = train_heads(target, heads_cfg(), data, tmp_path / "b", stop_after=6, **kw)
    assert first["step"] == 6 and not first["finished"]
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000004", "step-00000006"]  # keep_checkpoints=2
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000006")  # as if it crashed at step 6
    second = train_heads(target, heads_cfg(), data, tmp_path / "b", **kw)
    assert second["resumed_from"] == 4 and second["step"] == 12 and second["initial"] == first["initial"]
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="seq_len"):  # other settings: a clear error, no silent mix
        train_heads(target, heads_cfg(), data, tmp_path / "b", **{**kw, "seq_len": 32})


def test_feature_table_sees_the_same_pairs_and_learns(target, tmp_path):
    """Medusa-1 on a table of the frozen backbone's hidden states (one row per position, long
    prompts trimmed away) scores exactly the (position, head) pairs of the window path, and learns."""
    recs = synthetic_records()
    for r in recs[::2]:
        r["prompt_len"] = 20  # long prompts: their early positions teach no head and are dropped
    data = write_jsonl(tmp_path / "data.jsonl", recs)
    kw = dict(steps=30, save_every=100, **FAST)
    a = train_heads(target, heads_cfg(), data, tmp_path / "a", cache_features=True, rows_per_batch=64, **kw)
    b = train_heads(target, heads_cfg(), data, tmp_path / "b", cache_features=False, **kw)
    assert a["initial"]["positions"] == b["initial"]["positions"]
    for key in ("per_head_loss", "top1", "top5"):
        torch.testing.assert_close(torch.tensor(a["initial"][key]), torch.tensor(b["initial"][key]),
                                   rtol=1e-4, atol=1e-5)
    assert a["final"]["loss"] < 0.7 * a["initial"]["loss"]
    assert a["final"]["top1"][0] > a["initial"]["top1"][0] + 0.3


def test_medusa2_lora_leaves_target_untouched(tmp_path):
    model = tiny_llama(seed=3, vocab=V, hidden=H, scale=4.0).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    report = train_heads(model, heads_cfg(), data, tmp_path / "h2", mode="medusa2", steps=6,
                         warmup_heads_steps=2, lora_r=4, lr_backbone=1e-3, **FAST)
    assert report["step"] == 6 and "lm_loss" in report["final"] and "final_original_target" in report
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("lora" in name for name, _ in model.named_modules())
    assert not any(p.requires_grad for p in model.parameters())
    adapter = load_file(str(tmp_path / "h2" / "lora_adapter" / "adapter_model.safetensors"))
    lora_b = [t for n, t in adapter.items() if "lora_B" in n]
    assert lora_b and any(bool(t.abs().sum() > 0) for t in lora_b)  # the joint stage trained the backbone
    load_heads(tmp_path / "h2", model)  # the heads load against the original target


# ------------------------------------------------------------------------------------------ trees

def test_accuracy_and_greedy_tree(target, trained, tmp_path):
    d, _ = trained
    heads = load_heads(d / "heads", target).float()
    recs = synthetic_records(n=3, length=30)
    seqs, plens = [r["ids"] for r in recs], [r["prompt_len"] for r in recs]
    acc = head_topk_accuracy(target, heads, seqs, 4, prompt_lens=plens)
    assert len(acc) == K and all(len(row) == 4 for row in acc)
    assert all(0 <= a <= 1 for row in acc for a in row) and all(sum(row) <= 1 + 1e-9 for row in acc)
    assert acc[0][0] > 0.5
    # the same alignment as the loss: rank-0 accuracy == medusa_loss's top-1 on one sequence
    ids = torch.tensor(seqs[0])
    hidden = target.get_decoder()(input_ids=ids[None]).last_hidden_state
    mask = torch.arange(len(ids))[None] >= plens[0]
    with torch.no_grad():
        _, _, top1, _ = medusa_loss(heads(hidden), ids[None], mask)
    one = head_topk_accuracy(target, heads, seqs[:1], 1, prompt_lens=plens[:1])
    torch.testing.assert_close(torch.tensor([r[0] for r in one], dtype=torch.float64), top1.double(), atol=1e-6, rtol=0)
    out = tmp_path / "tree.json"
    res = build_tree(target, heads, seqs, 8, max_rank=4, prompt_lens=plens, out_path=out)
    paths = json.loads(out.read_text())
    assert paths == res["paths"] and len(paths) == 8
    assert [list(p) for p in normalize_paths(paths)] == paths
    assert all(1 <= len(p) <= K and all(0 <= r < 4 for r in p) for p in paths)
    assert 0 < res["expected_accepted_per_step"] <= 8
    with pytest.raises(ConfigError, match="without any position"):
        head_topk_accuracy(target, heads, [[1, 2, 3]], 2)


def test_sequential_heads_train_save_load_and_score(target, tmp_path):
    """Sequential heads learn on the feature table, reload as the same function, and are scored
    teacher-forced (rank-0 accuracy of depth k = top-1 of step k on the true tokens)."""
    from speculant.heads import SequentialHeads
    from speculant.training.losses import row_inputs, row_targets
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    cfg = HeadsConfig(K, 1, H, V, base_model="tiny-llama", kind="sequential")
    report = train_heads(target, cfg, data, tmp_path / "seq", steps=40, save_every=100, rows_per_batch=64, **FAST)
    assert report["final"]["loss"] < 0.5 * report["initial"]["loss"]
    assert min(report["final"]["top1"]) > max(report["initial"]["top1"]) + 0.3
    heads = load_heads(tmp_path / "seq", target).float()
    assert isinstance(heads, SequentialHeads) and heads.num_heads == K
    assert json.loads((tmp_path / "seq" / "config.json").read_text())["speculant_head_kind"] == "sequential"
    ids = torch.tensor(synthetic_records(n=1, length=30)[0]["ids"])
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids[None]).last_hidden_state[0]  # (T, H)
        logits = heads(hidden, row_inputs(ids, K))  # (K, T, V)
    tgt = row_targets(ids, torch.arange(len(ids)) >= 4, K)  # (T, K)
    acc = head_topk_accuracy(target, heads, [ids.tolist()], 1, prompt_lens=[4])
    for k in range(K):
        ok = tgt[:, k] >= 0
        want = (logits[k][ok].argmax(-1) == tgt[ok, k]).double().mean()
        assert abs(acc[k][0] - float(want)) < 1e-9
    with pytest.raises(ConfigError, match="sequential heads train"):
        train_heads(target, cfg, data, tmp_path / "m2", mode="medusa2", steps=1, **FAST)
    with pytest.raises(ConfigError, match="init-from"):  # medusa heads cannot start sequential ones
        train_heads(target, heads_cfg(), data, tmp_path / "bad", init_from=tmp_path / "seq", steps=1, **FAST)


def test_sequential_heads_with_a_context_layer_train_from_plain_heads(target, tmp_path):
    """A context layer trains on whole windows of the feature table; heads without one can start
    heads with one (the fresh layer is the identity, so the starting metrics are the plain heads'
    final ones); the result saves and loads with its layer; a width mismatch is a clear error."""
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    plain_cfg = HeadsConfig(K, 1, H, V, base_model="tiny-llama", kind="sequential")
    plain = train_heads(target, plain_cfg, data, tmp_path / "plain", steps=10, save_every=100, rows_per_batch=64,
                        **FAST)
    cfg = dataclasses.replace(plain_cfg, context_size=32)
    rep = train_heads(target, cfg, data, tmp_path / "ctx", steps=30, save_every=100, init_from=tmp_path / "plain",
                      lr_context=1e-2, **FAST)
    assert rep["initial"]["top1"] == pytest.approx(plain["final"]["top1"], abs=1e-6)
    assert rep["initial"]["loss"] == pytest.approx(plain["final"]["loss"], rel=1e-5)
    assert rep["final"]["loss"] < rep["initial"]["loss"]
    heads = load_heads(tmp_path / "ctx", target)
    assert heads.config.context_size == 32 and heads.context is not None
    assert float(heads.context.o.weight.detach().abs().max()) > 0  # the layer learnt something
    with pytest.raises(ConfigError, match="init-from"):
        train_heads(target, dataclasses.replace(cfg, context_size=16), data, tmp_path / "bad",
                    init_from=tmp_path / "ctx", steps=1, **FAST)


@pytest.mark.parametrize("kind", ["medusa", "sequential"])
def test_training_over_the_data_vocabulary(target, tmp_path, kind):
    """train_vocab='data': the loss covers only the tokens in the records (11 here), yet the heads
    learn and the held-out report still scores them over the whole vocabulary."""
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    cfg = dataclasses.replace(heads_cfg(), kind=kind)
    kw = dict(steps=40, save_every=100, rows_per_batch=64, **FAST)
    sub = train_heads(target, cfg, data, tmp_path / "sub", train_vocab="data", **kw)
    assert sub["train_vocab_size"] == len(set(PATTERN)) and sub["config"]["train_vocab"] == "data"
    assert sub["final"]["top1"][0] > sub["initial"]["top1"][0] + 0.3
    full = train_heads(target, cfg, data, tmp_path / "full", **kw)
    assert full["train_vocab_size"] == V and full["initial"] == sub["initial"]
    if kind == "medusa":  # (sequential heads need the feature table anyway)
        with pytest.raises(ConfigError, match="train_vocab"):
            train_heads(target, cfg, data, tmp_path / "bad", train_vocab="data", cache_features=False, **kw)


def test_feature_table_next_rows_and_feature_loss(target, tmp_path):
    """next_rows[i, d] is the row of position t+1+d of the same window (checked through the tokens:
    the inputs of that row start where row i's inputs continue, and its hidden state is the
    backbone's at that position); the feature loss trains sequential heads (and only them)."""
    from speculant.heads import make_heads
    from speculant.training.data import windows
    from speculant.training.features import FeatureTable, Trainable
    recs = synthetic_records(n=4, length=40)
    items = windows(recs, 64, False)
    heads = make_heads(dataclasses.replace(heads_cfg(), kind="sequential"), target)
    table = FeatureTable.build(items, K, Trainable(target, heads), "cpu", progress=False)
    nxt = table.next_rows
    assert nxt.shape == (len(table), K) and bool((nxt >= 0).any()) and bool((nxt < 0).any())
    for i in range(len(table)):
        for d in range(K - 1):
            j = int(nxt[i, d])
            if j >= 0:
                assert int(table.inputs[j, 0]) == int(table.inputs[i, d + 1])
    ids = torch.tensor(recs[0]["ids"])
    with torch.no_grad():
        h = target.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
    matches = [int(((table.hidden - h[p]).abs().amax(-1) < 1e-5).sum()) for p in (5, 10)]
    assert all(m >= 1 for m in matches)
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    cfg = dataclasses.replace(heads_cfg(), kind="sequential")
    kw = dict(steps=40, save_every=100, rows_per_batch=64, **FAST)
    rep = train_heads(target, cfg, data, tmp_path / "f", feature_weight=1.0, **kw)
    assert rep["final"]["top1"][0] > rep["initial"]["top1"][0] + 0.3 and rep["config"]["feature_weight"] == 1.0
    with pytest.raises(ConfigError, match="feature_weight"):
        train_heads(target, heads_cfg(), data, tmp_path / "m", feature_weight=1.0, **kw)


def test_teacher_loss_scores_the_targets_own_distribution_at_the_predicted_position(target, tmp_path):
    """Head k at position t is taught the target's distribution at t+k+1 (which predicts token
    t+k+2, the head's label): logits equal to exactly that reach the loss's minimum (Σ λ^k · entropy),
    the ones one position off score worse; training with it learns and is recorded; it needs the
    feature table."""
    from speculant.heads import make_heads
    from speculant.heads.projection import frozen_projection
    from speculant.training.data import windows
    from speculant.training.features import FeatureTable, Trainable, teacher_loss
    recs = synthetic_records(n=4, length=40)
    heads = make_heads(dataclasses.replace(heads_cfg(), kind="sequential"), target)
    table = FeatureTable.build(windows(recs, 64, False), K, Trainable(target, heads), "cpu", progress=False)
    rows = torch.arange(len(table))
    nxt = table.next_rows

    def project(h):
        return frozen_projection(target.get_output_embeddings(), h).float()

    def logits_at(offset):  # (K, n, V): the target's logits at next_rows[:, k + offset] (0 where none)
        out = torch.zeros(K, len(table), V)
        for k in range(K):
            col = nxt[:, min(k + offset, K - 1)] if k + offset >= 0 else rows
            ok = (nxt[:, k] >= 0) & (col >= 0)
            out[k, ok] = project(table.hidden[col[ok]])
        return out

    right = teacher_loss(logits_at(0), table, rows, project, 0.8, "cpu")
    entropy = sum(0.8 ** k * -(lambda p: (p * p.log()).sum(-1).mean())(project(table.hidden[nxt[nxt[:, k] >= 0, k]]).softmax(-1))
                  for k in range(K))
    torch.testing.assert_close(right, entropy)
    assert float(teacher_loss(logits_at(-1), table, rows, project, 0.8, "cpu")) > float(right) + 0.05
    assert float(teacher_loss(torch.zeros(K, len(table), V), table, rows, project, 0.8, "cpu")) > float(right) + 0.05
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    kw = dict(steps=40, save_every=100, rows_per_batch=64, **FAST)
    rep = train_heads(target, dataclasses.replace(heads_cfg(), kind="sequential"), data, tmp_path / "t",
                      teacher_weight=1.0, **kw)
    assert rep["final"]["top1"][0] > rep["initial"]["top1"][0] + 0.3 and rep["config"]["teacher_weight"] == 1.0
    with pytest.raises(ConfigError, match="teacher_weight scores the target's own logits"):
        train_heads(target, heads_cfg(), data, tmp_path / "n", teacher_weight=1.0, cache_features=False, **kw)
    with pytest.raises(ConfigError, match="feature_weight and teacher_weight must be >= 0"):
        train_heads(target, heads_cfg(), data, tmp_path / "m", teacher_weight=-1.0, **kw)


def test_feature_noise_weight_decay_and_held_out_history(target, tmp_path):
    """feature_noise and weight_decay change the training (not the held-out scoring before it),
    the heads still learn, and eval_every keeps a held-out history ending with the final metrics."""
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    cfg = dataclasses.replace(heads_cfg(), kind="sequential")
    kw = dict(steps=40, save_every=100, rows_per_batch=64, **FAST)
    plain = train_heads(target, cfg, data, tmp_path / "a", **kw)
    reg = train_heads(target, cfg, data, tmp_path / "b", feature_noise=0.1, weight_decay=0.1, eval_every=10, **kw)
    assert reg["initial"] == plain["initial"] and reg["final"] != plain["final"]
    assert reg["final"]["top1"][0] > reg["initial"]["top1"][0] + 0.3
    assert [h["step"] for h in reg["history"]] == [10, 20, 30, 40] and reg["history"][-1]["top1"] == reg["final"]["top1"]
    with pytest.raises(ConfigError, match="feature_noise"):
        train_heads(target, cfg, data, tmp_path / "c", feature_noise=-1.0, **kw)
    with pytest.raises(ConfigError, match="feature_noise perturbs the rows of the feature table"):
        train_heads(target, heads_cfg(), data, tmp_path / "d", feature_noise=0.1, cache_features=False, **kw)


def test_feature_cache_reused(target, tmp_path, monkeypatch):
    """A second run on the same data reads the kept tables (the backbone does not run again) and
    trains exactly as the first."""
    from speculant.training import features
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    kw = dict(steps=5, save_every=100, rows_per_batch=64, feature_cache=str(tmp_path / "cache"), **FAST)
    first = train_heads(target, heads_cfg(), data, tmp_path / "a", **kw)
    assert len(list((tmp_path / "cache").glob("features-*.pt"))) == 1

    def no_backbone(*a, **k):
        raise AssertionError("the backbone ran again")
    monkeypatch.setattr(features.FeatureTable, "build", no_backbone)
    second = train_heads(target, heads_cfg(), data, tmp_path / "b", **kw)
    assert second["initial"] == first["initial"] and second["final"] == first["final"]


def test_draft_vocabulary_from_the_answers(target, tmp_path):
    from speculant.training.setup import draft_vocabulary
    recs = [{"prompt_len": 2, "ids": [60, 61, 9, 9, 9, 7, 7, 30]}, {"prompt_len": 1, "ids": [62, 30, 7]}]
    assert draft_vocabulary(recs, 2, V).tolist() == [7, 9]  # 7 and 9: three times each; 30 twice
    assert draft_vocabulary(recs, 5, V).tolist() == [0, 1, 7, 9, 30]  # then the lowest free ids
    data = write_jsonl(tmp_path / "data.jsonl", synthetic_records())
    cfg = dataclasses.replace(heads_cfg(), kind="sequential", draft_vocab=16)
    train_heads(target, cfg, data, tmp_path / "dv", steps=2, save_every=100, rows_per_batch=64, **FAST)
    heads = load_heads(tmp_path / "dv", target)
    assert set(PATTERN) <= set(heads.draft_vocab.tolist()) and heads.draft_vocab.numel() == 16


# ------------------------------------------------------------------------------------------ data

def test_stdlib_prompts_deterministic_and_clean():
    a, b = stdlib_prompts(), stdlib_prompts()
    assert a == b and len(a) > 500 and len(set(a)) == len(a)
    assert all(p.strip() and "`" in p for p in a)
    assert stdlib_prompts(limit=10) == a[:10]
    assert any("json.dumps" in p for p in a)


def test_training_on_several_files_and_from_given_heads(target, trained, tmp_path):
    """Records of several files are trained on together; --init-from starts from given heads
    (its initial held-out score is theirs, not a fresh init's) and refuses heads of another shape."""
    d, report = trained
    recs = synthetic_records()
    a, b = write_jsonl(tmp_path / "a.jsonl", recs[:6]), write_jsonl(tmp_path / "b.jsonl", recs[6:])
    kw = dict(steps=2, save_every=100, **FAST)
    split = train_heads(target, heads_cfg(), [a, b], tmp_path / "split", **kw)
    whole = train_heads(target, heads_cfg(), write_jsonl(tmp_path / "all.jsonl", recs), tmp_path / "whole", **kw)
    assert split["initial"] == whole["initial"] and split["train_rows"] == whole["train_rows"]
    warm = train_heads(target, heads_cfg(), [a, b], tmp_path / "warm", init_from=d / "heads", **kw)
    assert warm["initial"]["top1"][0] > split["initial"]["top1"][0] + 0.3
    with pytest.raises(ConfigError, match="init-from"):
        train_heads(target, heads_cfg(num_layers=2), [a, b], tmp_path / "bad", init_from=d / "heads", **kw)


def test_english_prompts_deterministic_balanced_and_not_spec_bench():
    from speculant.training.data import _norm, _spec_bench_text
    from speculant.training.prompts import english_prompt_families, english_prompts
    german = ["Das ist ein Test .", "Guten Morgen ."]
    fams = english_prompt_families(german)
    assert english_prompts(german) == english_prompts(german) and len(fams) == 8
    assert all(len(f) >= 2 for f in fams.values()) and fams["de-en"][0] == "Translate German to English: Das ist ein Test ."
    first = english_prompts(german)[:8]
    assert [next(k for k, f in fams.items() if p in f) for p in first] == list(fams)  # every family early
    blocked = english_prompts(german, block=4)
    assert sorted(blocked) == sorted(english_prompts(german)) and blocked[:4] == fams["write"][:4]
    eval_text = _spec_bench_text()
    assert not any(_norm(p) in eval_text for f in fams.values() for p in f)
    # part 1: a disjoint set (the combinations part 0 left out, new questions and numbers), also clean
    p0, p1 = english_prompts(german, block=32), english_prompts(german, block=32, part=1)
    fams1 = english_prompt_families(german, part=1)
    assert len(p1) > 500 and len(set(p1) & set(p0)) < 0.06 * len(p1)  # (a few repeated numbers, passages)
    assert not any(set(fams1[f]) & set(fams[f]) for f in ("write", "explain", "role", "qa"))
    assert fams1["qa"][0] not in p0 and fams1["math"][0] != fams["math"][0]
    assert not any(_norm(p) in eval_text for f in fams1.values() for p in f)
    with pytest.raises(ValueError, match="part must be 0 or 1"):
        english_prompts(german, part=2)


def test_wmt_prompts_load_without_spec_bench_overlap():
    allp, kept = wmt_prompts(exclude_eval=False), wmt_prompts()
    assert len(allp) == 1000 and 900 < len(kept) < 1000
    assert all(p.startswith("Translate the input English sentence into German.\nInput: ") for p in kept)
    assert not any("Mr Snowden in Russia" in p for p in kept)  # a Spec-Bench reference sentence
    mixed = mixed_prompts(n_stdlib=3, n_wmt=2)
    assert len(mixed) == 5 and mixed[1] == kept[0] and mixed[0] == stdlib_prompts(limit=1)[0]


def test_distill_writes_resumable_jsonl(tmp_path):
    import speculant

    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    dec = speculant.SpeculativeDecoder(str(model_dir), method="ar", chat=True, dtype="float32")
    calls = []
    generate = dec.generate
    dec.generate = lambda prompt, n: calls.append(prompt) or generate(prompt, n)
    prompts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9"]
    path = tmp_path / "d" / "distill.jsonl"
    first = distill(dec, prompts[:2], 6, path, progress=False)
    assert calls == prompts[:2] and len(load_records(path)) == 2
    with path.open("a") as f:
        f.write('{"prompt": "w6 w7 w8 w9", "ids": [1, 2')  # a torn line from a crash
    seqs = distill(dec, prompts, 6, path, progress=False)
    assert calls == prompts  # only the missing prompt was generated
    assert seqs[:2] == first and len(seqs) == 3
    recs = load_records(path)
    assert [r["prompt"] for r in recs] == prompts and len(path.read_text().splitlines()) == 3
    for r, s in zip(recs, seqs):
        assert r["ids"] == s and r["ids"][:r["prompt_len"]] == dec.encode(r["prompt"]).tolist()
        assert 1 <= len(r["ids"]) - r["prompt_len"] <= 6
        ref = generate(r["prompt"], 6).token_ids  # greedy: the answer is the target's own output
        assert r["ids"][r["prompt_len"]:] == ref
    # the file trains heads end to end (LoadedModel target)
    hidden = dec.target.model.config.hidden_size
    report = train_heads(dec.target, HeadsConfig(2, 1, hidden, V), path, tmp_path / "h", steps=2,
                         held_out_fraction=0.34, batch_size=2, seq_len=32, progress=False)
    assert report["step"] == 2 and math.isfinite(report["final"]["loss"])


@pytest.mark.parametrize("backend", ["hf", "native"])  # transformers' batched generate; speculant's engine
def test_batched_distill_equals_one_at_a_time(tmp_path, backend):
    """Batched distillation gives the same greedy answers as one prompt at a time (fp32)."""
    import speculant

    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    dec = speculant.SpeculativeDecoder(str(model_dir), method="lookup" if backend == "native" else "ar", chat=True,
                                       dtype="float32", backend=backend)
    prompts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10 w11", "w12"]
    one = distill(dec, prompts, 7, progress=False)
    batched = distill(dec, prompts, 7, tmp_path / "b.jsonl", progress=False, batch_size=3)
    assert batched == one
    if backend == "native":  # 2 at a time out of a group of 4: the batch refills as answers end
        assert distill(dec, prompts, 7, tmp_path / "g.jsonl", progress=False, batch_size=2, group=4) == one
    assert [r["prompt"] for r in load_records(tmp_path / "b.jsonl")] == prompts
