"""The bench at a temperature: the target NLL of sampled tokens (``bench.quality.sampled_nll``),
scored in chunks, equals one unchunked pass for every prompt length and chunk boundary; every
method samples through the bench, prompts longer than a scoring chunk included; the tables show
the NLL, not an output comparison, for sampled runs."""

from __future__ import annotations

import json

import pytest
import torch

from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend
from speculant.bench import quality
from speculant.bench.harness import BenchConfig, run_bench, select
from speculant.specbench import load_questions
from speculant.bench.report import load_result, markdown_table
from speculant.store.chat import chat_prompt

from tiny import tiny_llama, tiny_model_dir

V = 64
LONG = " ".join(f"w{3 + i % 17}" for i in range(300))  # 300 tokens: more than two scoring chunks of 128


def _reference(model, ids: torch.Tensor, n0: int, temperature: float) -> float:
    """Mean -log p_T of ids[n0:] from one transformers pass over the whole sequence."""
    with torch.no_grad():
        lp = (model(ids[None]).logits[0].float() / temperature).log_softmax(-1)
    return -lp[n0 - 1:-1].gather(1, ids[n0:, None]).mean().item()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, scale=4.0)


@pytest.mark.parametrize("runtime", [HFBackend, NativeBackend], ids=["hf", "native"])
@pytest.mark.parametrize("n0, k", [(300, 40), (300, 1), (200, 100), (128, 5), (129, 1), (127, 1), (127, 2),
                                   (1, 10), (10, 300), (256, 3)])
def test_sampled_nll_in_chunks_equals_one_pass(model, runtime, n0, k):
    """Prompts shorter and longer than a chunk, answers that start mid-chunk, at a chunk's first
    or last row, or several chunks on, and answers that span chunks."""
    assert quality.CHUNK == 128
    ids = torch.randint(0, V, (n0 + k,), generator=torch.Generator().manual_seed(n0 * 1000 + k))
    got = quality.sampled_nll(runtime(model), ids[:n0], ids[n0:].tolist(), 0.7)
    assert got == pytest.approx(_reference(model, ids, n0, 0.7), abs=1e-4)


def test_sampled_nll_at_every_chunk_boundary(model, monkeypatch):
    """Chunks of 4 rows: every offset of the prompt's end and of the answer's end in a chunk."""
    monkeypatch.setattr(quality, "CHUNK", 4)
    backend = NativeBackend(model)
    g = torch.Generator().manual_seed(0)
    for n0 in range(1, 14):
        for k in range(1, 10):
            ids = torch.randint(0, V, (n0 + k,), generator=g)
            got = quality.sampled_nll(backend, ids[:n0], ids[n0:].tolist(), 1.3)
            assert got == pytest.approx(_reference(model, ids, n0, 1.3), abs=1e-4), (n0, k)
    assert quality.sampled_nll(backend, ids[:3], [], 1.0) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from speculant import SpeculativeDecoder
    from speculant.eagle.checkpoint import save_eagle
    from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads, save_heads
    from test_eagle import eagle_for

    root = tmp_path_factory.mktemp("sampled-bench")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3)
    lm = SpeculativeDecoder(str(target), method="ar", dtype="float32").target.model
    H, g = lm.config.hidden_size, torch.Generator().manual_seed(0)

    def randomized(heads):
        with torch.no_grad():
            for p in heads.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        return heads.eval()

    save_heads(randomized(MedusaHeads(HeadsConfig(3, 1, H, V), lm.get_output_embeddings())), root / "medusa")
    save_heads(randomized(SequentialHeads(HeadsConfig(3, 1, H, V, kind="sequential"), lm.get_output_embeddings(),
                                          lm.get_input_embeddings())), root / "hydra")
    save_eagle(eagle_for(lm), root / "eagle")
    questions = root / "questions.jsonl"
    texts = ["w1 w2 w3 w4 w1 w2", LONG, "w5"]  # a short prompt, one longer than a scoring chunk, one token
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                                 for i, t in enumerate(texts, start=1)))
    return {"target": str(target), "draft": str(draft), "questions": str(questions), "root": root}


def _methods(tiny) -> tuple[str, ...]:
    r = tiny["root"]
    return ("ar", "auto", "lookup", "sd", "mcsd", f"medusa@heads={r / 'medusa'}", f"hydra+lookup@heads={r / 'hydra'}",
            f"bpd@heads={r / 'medusa'}@gamma=3", f"eagle+lookup@heads={r / 'eagle'}",
            f"medusa:typical@heads={r / 'medusa'}")


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_bench_samples_every_method_and_prompt_length(tiny, tmp_path, capsys, backend):
    methods = _methods(tiny)
    out = tmp_path / "sampled.json"
    res = run_bench(BenchConfig(tiny["target"], tiny["draft"], methods=methods, per_category=3, max_new_tokens=8,
                                dtype="float32", categories=("qa",), questions=tiny["questions"], temperature=0.7,
                                seed=1, tree_budget="fixed", backend=backend,
                                target_quant="none" if backend == "native" else "auto", json_out=str(out)))
    assert list(res["summary"]) == list(methods) and len(res["runs"]) == 3 * len(methods)
    for m, s in res["summary"].items():
        assert s["identical_to_plain"] is None and s["identical_to_ar"] is None, m
        assert 0 < s["target_nll"] < 20 and s["tokens_per_call"] >= 1 and s["prompts"] == 3, m
    # the long prompt's rows: the chunked NLL equals one unchunked pass of the target
    from transformers import AutoModelForCausalLM

    from speculant.store.models import load

    model = AutoModelForCausalLM.from_pretrained(tiny["target"], dtype=torch.float32).eval()
    tok = load(tiny["target"], "float32").tokenizer
    q = select(load_questions(tiny["questions"]), 3, ("qa",))[1]
    ids = tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0]
    assert ids.shape[0] > quality.CHUNK
    for row in (r for r in res["runs"] if r["question_id"] == q["question_id"] and r["token_ids"]):
        full = torch.cat([ids, torch.tensor(row["token_ids"], dtype=torch.long)])
        assert row["target_nll"] == pytest.approx(_reference(model, full, ids.shape[0], 0.7), abs=1e-3), row["method"]
    # the table's last column is the NLL, not an output comparison
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 80
    header = next(line for line in text.splitlines() if line.startswith("method"))
    assert header.split()[-1] == "nll" and "same" not in header
    ar_line = next(line for line in text.splitlines() if line.startswith("ar "))
    assert ar_line.split()[-1] == f"{res['summary']['ar']['target_nll']:.2f}"
    assert "outputs are not compared" in " ".join(text.split())
    md = markdown_table(load_result(out), str(out))
    assert "| target nll |" in md and "same as plain" not in md.lower() and "sampled at temperature 0.7" in md


def test_cli_bench_at_a_temperature_with_a_long_prompt(tiny, tmp_path, capsys):
    from speculant.cli.commands import main

    argv = ["bench", "--target", tiny["target"], "--draft", tiny["draft"], "--methods", "ar,auto,lookup,sd",
            "--dtype", "float32", "--questions", tiny["questions"], "--categories", "qa", "--per-category", "3",
            "--max-new-tokens", "6", "--temperature", "0.7", "--seed", "1", "--json-out", str(tmp_path / "b.json")]
    assert main(argv) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "b.json").read_text())
    assert all(r["target_nll"] is not None for r in saved["runs"] if r["new_tokens"])
    assert "Traceback" not in capsys.readouterr().err
