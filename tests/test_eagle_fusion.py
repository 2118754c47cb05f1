"""EAGLE-3's feature fusion: the runtimes hand out the residual stream entering chosen layers beside
the final state, a drafter reading them decodes exactly as plain decoding, a drafter widened to read
them starts as the drafter it was, and features computed with other layers are refused."""

from __future__ import annotations

import pytest
import torch

from speculant.backends.base import ForwardRequest, HiddenNeed, forward_batch
from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend, NativeModel
from speculant.drafters.base import NoDrafter
from speculant.drafters.dynamic_tree import DynamicTree
from speculant.drafters.lookup import LookupDrafter
from speculant.eagle import EagleCache, EagleDrafter
from speculant.eagle.narrow import with_fused_layers
from speculant.errors import ConfigError

from helpers import decode_to_end, greedy_records
from test_eagle import eagle_for
from tiny import fixed_prompts, tiny_qwen2

V = 64


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(seed=0, scale=4.0)


def _states_entering(target, ids: torch.Tensor, layers) -> list[torch.Tensor]:
    """transformers' own hidden_states[i]: the residual stream entering layer i, (n, H) each."""
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
    return [out.hidden_states[i][0] for i in layers]


@pytest.mark.parametrize("runtime", ["hf", "native"])
def test_runtimes_return_the_states_entering_the_layers(target, runtime):
    backend = HFBackend(target) if runtime == "hf" else NativeBackend(NativeModel.from_hf(target))
    ids = fixed_prompts(V)[0]
    H = target.config.hidden_size
    backend.reset()
    plain = backend.forward(ids, want_hidden=HiddenNeed.ALL)
    backend.reset()
    out = backend.forward(ids, want_hidden=HiddenNeed.ALL, layers=(1, 0))
    assert out.hidden.shape == (ids.shape[0], 3 * H)
    assert torch.equal(out.hidden[:, :H], plain.hidden) and torch.equal(out.logits, plain.logits)
    low, embedded = _states_entering(target, ids, (1, 0))
    torch.testing.assert_close(out.hidden[:, H:2 * H], low, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[:, 2 * H:], embedded, atol=1e-5, rtol=1e-5)
    backend.reset()
    rows = torch.tensor([2, ids.shape[0] - 1])
    last = backend.forward(ids, rows=rows, want_hidden=HiddenNeed.LAST, layers=(1, 0))
    assert torch.equal(last.hidden, out.hidden[rows])
    backend.reset()
    with pytest.raises(ValueError, match=r"layers \[7\] were asked of a model of 2 layers"):
        backend.forward(ids, want_hidden=HiddenNeed.ALL, layers=(7,))


def test_batched_native_passes_return_each_sequence_its_own_states(target):
    model = NativeModel.from_hf(target)
    a, b = NativeBackend(model), NativeBackend(model)
    p, q = fixed_prompts(V)[:2]
    both = forward_batch([a, b], [ForwardRequest(p, want_hidden=HiddenNeed.ALL, layers=(1,)),
                                  ForwardRequest(q, rows=torch.tensor([1]), want_hidden=HiddenNeed.LAST)])
    a.reset(), b.reset()
    alone = a.forward(p, want_hidden=HiddenNeed.ALL, layers=(1,))
    assert torch.equal(both[0].hidden, alone.hidden)
    assert both[1].hidden.shape == (1, target.config.hidden_size)  # no layers asked: the final state alone


def test_a_drafter_widened_to_read_layers_starts_as_it_was(target):
    backend = HFBackend(target)
    ids = fixed_prompts(V)[1]
    backend.reset()
    states = backend.forward(ids[:-1], want_hidden=HiddenNeed.ALL, layers=(1,)).hidden  # (n, 2H)
    H = target.config.hidden_size
    model = eagle_for(target, input_scale=True)
    wide = with_fused_layers(model, (1,), states)
    assert wide.config.fused_layers == (1,) and wide.config.state_width == 2 * H
    assert not wide.fuse.weight.any() and bool((wide.fuse_scale > 0).all())
    tokens = ids[1:]
    assert torch.equal(wide(states[None], tokens[None]), model(states[None, :, :H], tokens[None]))
    f_wide = wide.extend(EagleCache(), states, tokens)
    f_old = model.extend(EagleCache(), states[:, :H], tokens)
    assert torch.equal(f_wide, f_old)
    with pytest.raises(ValueError, match="width 128, got 64"):
        wide.extend(EagleCache(), states[:, :H], tokens)  # committed pairs without the layers' states
    with pytest.raises(ConfigError, match="already reads layers"):
        with_fused_layers(wide, (1,), states)


@pytest.mark.parametrize("runtime", ["hf", "native"])
def test_fused_eagle_decoding_equals_plain_decoding(target, runtime):
    backend = HFBackend(target) if runtime == "hf" else NativeBackend(NativeModel.from_hf(target))
    model = eagle_for(target, fused_layers=(1,))
    assert model.fuse.weight.abs().sum() > 0  # the layer's states change what it drafts
    drafters = [EagleDrafter(model, DynamicTree(nodes=10), V),
                EagleDrafter(model, DynamicTree(nodes=6, depth=3, top_k=4, beam=2), V, LookupDrafter(3))]
    for prompt in fixed_prompts(V):
        plain = decode_to_end(backend, NoDrafter(), prompt, n=30).generated
        for drafter in drafters:
            assert drafter.hidden_layers == (1,)
            assert decode_to_end(backend, drafter, prompt, n=30).generated == plain
        assert drafters[0].proposer.source.cache.length == prompt.shape[0] + 29


def test_features_name_their_layers_and_others_are_refused(target, tmp_path):
    from speculant.training.eagle_features import FirstColumns, compute_features, load_features

    backend = HFBackend(target)
    g = torch.Generator().manual_seed(3)
    records = [{"prompt": "", "prompt_len": 3, "ids": torch.randint(0, V, (6 + i,), generator=g).tolist()}
               for i in range(5)]
    out = compute_features(backend, records, tmp_path / "f", shard_records=2, progress=False, layers=(1,))
    hidden, starts = load_features(out, records, (1,))
    H = target.config.hidden_size
    assert hidden.shape == (int(starts[-1]), 2 * H)
    backend.reset()
    alone = backend.forward(torch.tensor(records[3]["ids"]), want_hidden=HiddenNeed.ALL, layers=(1,)).hidden
    torch.testing.assert_close(hidden[starts[3]:starts[4]], alone.to(torch.bfloat16))
    final = FirstColumns(hidden, H)
    assert final.shape == (int(starts[-1]), H) and torch.equal(final[2:9], hidden[2:9][:, :H])
    alone, _ = load_features(out, records)  # the final states alone: the first columns
    assert alone.shape == (int(starts[-1]), H) and torch.equal(alone[:], hidden[:][:, :H])
    with pytest.raises(ConfigError, match=r"holds the states entering layers \[1\], the drafter reads layers \[0\]"):
        load_features(out, records, (0,))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    compute_features(backend, records, out, shard_records=2, progress=False)  # other layers: every shard again
    after = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert all(after[k] != before[k] for k in before)
    assert load_features(out, records)[0].shape == (int(starts[-1]), H)


def test_training_moves_the_fusion_and_the_cli_reads_its_layers(target, tmp_path):
    from speculant.cli.training import _layer_list
    from speculant.training.eagle_train import EagleTrainConfig, compute_features, load_features, train_eagle

    backend = HFBackend(target)
    records = greedy_records(backend, 12, 30, V)
    feats = load_features(compute_features(backend, records, tmp_path / "f", progress=False, layers=(1,)), records,
                          (1,))
    model = with_fused_layers(eagle_for(target, scale=0.05), (1,), feats[0][:])
    cfg = EagleTrainConfig(steps=20, batch_size=4, seq_len=32, lr=3e-3, warmup=2, held_out=2, eval_depth=2,
                           checkpoint_every=100, token_weight=1.0, precision="float32")
    report = train_eagle(model, records, feats, tmp_path / "run", cfg, progress=False)
    assert report["steps"] == 20 and model.fuse.weight.abs().sum() > 0
    assert _layer_list(None) is None and _layer_list("none") == () and _layer_list("2, 14") == (2, 14)
    with pytest.raises(ConfigError, match="--fuse-layers takes comma-separated layer numbers"):
        _layer_list("low,mid")


def test_a_fused_drafter_is_not_exported_to_layouts_that_cannot_hold_it(target, tmp_path):
    from speculant.eagle.export import export_eagle

    for fmt in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match=r"entering layers \[1\].*export a drafter trained without --fuse-layers"):
            export_eagle(eagle_for(target, fused_layers=(1,)), tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()
