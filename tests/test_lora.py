"""A peft LoRA adapter merged into the target at load time (``lora=DIR``, ``--lora DIR``): the
merged model's logits are peft's own adapted model's (and not the base model's), every method's
greedy output equals plain greedy decoding of the adapted model on both backends (and on the int4
runtime, the adapted weights quantized), and a Medusa-2 run's adapter and heads decode end to end
from the command line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculant import SpeculativeDecoder
from speculant.tuning.costmodel import PassCost
from speculant.errors import ConfigError, ModelLoadError
from speculant.heads import HeadsConfig, MedusaHeads, save_heads
from speculant.kernels import x86_kernels
from speculant.store.lora import merge_lora

from tiny import lora_adapter, tiny_llama, tiny_model_dir, word_tokenizer

V = 64
FLAT = PassCost((1, 64), (100.0, 100.0))  # no measuring in tests
PROMPTS = ["w1 w2 w3 w4 w1 w2 w3", "w20 w9 w31", " ".join(f"w{3 + i % 11}" for i in range(40))]
KERNELS = x86_kernels() is not None


def peft_adapted(model_dir, adapter, dtype=torch.float32):
    """peft's own adapted model (the adapter applied on the fly, not merged)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return PeftModel.from_pretrained(model, str(adapter)).eval()


def random_heads(model_dir, out, seed: int = 0):
    """Medusa heads with random weights over the model's output layer, saved to ``out``."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    heads = MedusaHeads(HeadsConfig(3, 1, model.config.hidden_size, V), model.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    save_heads(heads, out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1)
    return {"target": target, "draft": draft, "adapter": lora_adapter(target, root / "adapter"),
            "heads": random_heads(target, root / "heads"), "root": root}


def test_merged_logits_are_pefts_adapted_logits(tiny):
    ids = torch.tensor([[5, 9, 17, 3, 40, 22, 8]])
    with torch.no_grad():
        want = peft_adapted(tiny["target"], tiny["adapter"])(ids).logits[0]
        base = AutoModelForCausalLM.from_pretrained(str(tiny["target"]))(ids).logits[0]
    assert (want - base).abs().max() > 0.5  # the adapter changes the model a lot
    for backend in ("hf", "native"):
        dec = SpeculativeDecoder(str(tiny["target"]), method="ar", dtype="float32", backend=backend,
                                 lora=str(tiny["adapter"]))
        assert "LoRA adapter" in dec.why
        got = dec.target_backend.forward(ids[0]).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    # a caller's model is merged on a private copy, never in place
    from speculant.store.models import load

    given = load(str(tiny["target"]), "float32")
    before = given.model.model.layers[0].self_attn.q_proj.weight.clone()
    dec = SpeculativeDecoder(given, method="ar", backend="hf", lora=str(tiny["adapter"]))
    assert torch.equal(given.model.model.layers[0].self_attn.q_proj.weight, before)
    torch.testing.assert_close(dec.target_backend.forward(ids[0]).logits, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_every_method_decodes_the_adapted_model_losslessly(tiny, backend):
    """Greedy speculative output with ``lora=`` equals plain greedy decoding of the adapted model,
    which is peft's adapted model's own greedy output (and not the base model's)."""
    kw = dict(dtype="float32", backend=backend, lora=str(tiny["adapter"]), tree_budget=FLAT)
    target = str(tiny["target"])
    plain = SpeculativeDecoder(target, method="ar", **kw)
    want = [plain.generate(p, 24).token_ids for p in PROMPTS]
    adapted = peft_adapted(tiny["target"], tiny["adapter"])  # the reference: peft's model, generating by itself
    for p, w in zip(PROMPTS, want):
        ids = plain.encode(p)[None]
        out = adapted.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                               do_sample=False, pad_token_id=0)  # ends at the model's EOS, as speculant does
        assert out[0, ids.shape[1]:].tolist() == w
    base = SpeculativeDecoder(target, method="ar", dtype="float32", backend=backend)
    assert [base.generate(p, 24).token_ids for p in PROMPTS] != want
    for method, extra in [("lookup", {"gamma": 3}), ("sd", {"draft": str(tiny["draft"]), "gamma": 3}),
                          ("medusa", {"heads": str(tiny["heads"]), "tree": "2x2x1"}),
                          ("medusa", {"heads": str(tiny["heads"]), "tree": "dynamic", "lookup_branch": 3})]:
        dec = SpeculativeDecoder(target, method=method, **kw, **extra)
        assert [dec.generate(p, 24).token_ids for p in PROMPTS] == want, (method, extra)


@pytest.mark.skipif(not KERNELS, reason="needs speculant's int4 kernel (row-invariant)")
def test_int4_runtime_quantizes_the_adapted_weights(tmp_path):
    """bf16 on the native int4 runtime: the adapter is merged before quantization, so decoding
    with ``lora=`` equals decoding a model directory that holds the adapted weights (merged by peft
    the same way), token for token, for every method."""
    model = tiny_llama(seed=0, vocab=V, hidden=64, scale=4.0)  # layer sizes in multiples of 64: int4 fits
    model.generation_config.eos_token_id = 2
    model.save_pretrained(tmp_path / "q")
    word_tokenizer(V).save_pretrained(tmp_path / "q")
    adapter = lora_adapter(tmp_path / "q", tmp_path / "adapter", dtype=torch.bfloat16, std=0.2)
    merged = peft_adapted(tmp_path / "q", adapter, torch.bfloat16).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    word_tokenizer(V).save_pretrained(tmp_path / "merged")
    heads = random_heads(tmp_path / "q", tmp_path / "heads")
    kw = dict(backend="native", dtype="bfloat16", target_quant="int4", tree_budget=FLAT)
    prompts = [[7], torch.randint(3, 14, (40,), generator=torch.Generator().manual_seed(5)).tolist()]
    want = [SpeculativeDecoder(str(tmp_path / "merged"), method="ar", **kw).generate(p, 24).token_ids for p in prompts]
    base = [SpeculativeDecoder(str(tmp_path / "q"), method="ar", **kw).generate(p, 24).token_ids for p in prompts]
    assert base != want
    for method, extra in (("ar", {}), ("lookup", {}), ("medusa", {"heads": str(heads)})):
        dec = SpeculativeDecoder(str(tmp_path / "q"), method=method, lora=str(adapter), **kw, **extra)
        assert dec.target.model.quant == "int4"
        assert [dec.generate(p, 24).token_ids for p in prompts] == want, method


def test_adapters_that_do_not_fit_are_refused(tiny, tmp_path):
    """An adapter for another hidden size, for modules the target lacks (a deeper model: peft
    itself would skip them silently), for another architecture: a ModelLoadError naming the
    directory, before peft touches the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = tmp_path / "wide"  # the target's architecture, hidden size 64 instead of 48
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(wide)
    config = json.loads((tiny["adapter"] / "adapter_config.json").read_text())
    qwen = {**config, "auto_mapping": {"base_model_class": "Qwen2ForCausalLM", "parent_library": "x"}}
    cases = {"another hidden size": (lora_adapter(wide, tmp_path / "a-wide"), "does not fit the target: model.layers.0"),
             "a deeper model": (_edited(tiny["adapter"], tmp_path / "a-deep", rename=("layers.1.", "layers.7.")),
                                "adapts model.layers.7."),
             "another class": (_edited(tiny["adapter"], tmp_path / "a-qwen", config=qwen),
                               "made for a Qwen2ForCausalLM")}
    model = AutoModelForCausalLM.from_pretrained(str(tiny["target"]))
    before = copy.deepcopy(model.state_dict())
    for what, (adapter, message) in cases.items():
        with pytest.raises(ModelLoadError, match=message) as e:
            merge_lora(model, adapter)
        assert str(adapter) in str(e.value) and "\n" not in str(e.value), what
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert not any("lora" in n for n, _ in model.named_modules())
    with pytest.raises(ConfigError, match="no peft adapter"):
        SpeculativeDecoder(str(tiny["target"]), method="ar", dtype="float32", lora=str(tiny["target"]))


def _edited(adapter, out, rename=None, config=None):
    """A copy of the adapter directory with its weights' names or its configuration changed."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    if rename:
        weights = {k.replace(*rename): v for k, v in weights.items()}
    save_file(weights, str(out / "adapter_model.safetensors"))
    cfg = config or json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def test_medusa2_adapter_and_heads_from_the_command_line(tiny, tmp_path, capsys):
    """train-heads --mode medusa2 on a tiny model, then generate with its heads and --lora: every
    method's output is plain decoding of the adapted model; without --lora the heads come with a
    note that the adapter beside them is not applied."""
    from speculant.cli.commands import main

    pattern = [5, 17, 9, 33, 42, 41, 12, 27, 50, 8, 19]  # no EOS (2)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"r{i}", "prompt_len": 4, "ids": [pattern[(i + j) % 11]
                                                                                     for j in range(40)]}) + "\n"
                            for i in range(8)))
    out = tmp_path / "m2"
    assert main(["train-heads", "--target", str(tiny["target"]), "--out", str(out), "--data", str(data), "--skip-distill",
                 "--mode", "medusa2", "--steps", "4", "--warmup-heads-steps", "1", "--lora-r", "4",
                 "--lr-backbone", "0.05", "--num-heads", "2", "--seq-len", "32", "--batch-size", "2",
                 "--held-out", "0.25", "--dtype", "float32"]) == 0
    adapter = out / "lora_adapter"
    assert (adapter / "adapter_config.json").is_file()
    capsys.readouterr()

    def run(*args):
        code = main(["generate", "--json", "--dtype", "float32", "--target", str(tiny["target"]),
                     "--max-new-tokens", "16", *args, PROMPTS[0]])
        o, e = capsys.readouterr()
        assert code == 0, e
        return json.loads(o)["token_ids"], e

    plain, err = run("--method", "ar", "--lora", str(adapter))
    assert f"LoRA adapter {adapter} merged into the target" in err
    for method, extra in [("medusa", ["--tree", "2x1"]), ("bpd", ["--gamma", "2"]), ("lookup", [])]:
        heads = ["--heads", str(out)] if method != "lookup" else []
        assert run("--method", method, "--lora", str(adapter), *heads, *extra)[0] == plain, method
    original, err = run("--method", "medusa", "--heads", str(out), "--tree", "2x1")
    assert f"pass --lora {adapter}" in err  # the note: the heads' adapter is not applied
    assert original == run("--method", "ar")[0] != plain  # the adapter trained: another model
    # the heads' directory itself is not an adapter: the error says where the adapter is
    assert main(["generate", "--target", str(tiny["target"]), "--lora", str(out), PROMPTS[0]]) == 2
    err = capsys.readouterr().err
    assert f"pass {adapter}" in err and err.startswith("speculant: error:") and "Traceback" not in err


def test_bench_decodes_the_adapted_model_and_skips_the_peers(tiny, tmp_path):
    from speculant.bench.harness import BenchConfig, run_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [PROMPTS[1]]}) + "\n")
    res = run_bench(BenchConfig(str(tiny["target"]), str(tiny["draft"]), methods=("ar", "lookup", "hf-assisted"),
                                max_new_tokens=12, dtype="float32", categories=("qa",), questions=str(questions),
                                tree_budget="fixed", lora=str(tiny["adapter"])))
    assert "original weights" in res["skipped"]["hf-assisted"] and list(res["summary"]) == ["ar", "lookup"]
    adapted = SpeculativeDecoder(str(tiny["target"]), method="ar", dtype="float32", chat=True, lora=str(tiny["adapter"]))
    want = adapted.generate(PROMPTS[1], 12).token_ids
    assert len(want) == 12 and [r["token_ids"] for r in res["runs"]] == [want, want]
