"""The llama-server peer (a benchmark extra built by `make install-llama-server`): plain greedy
decoding through llama.cpp's own server stops at EOS or max_new_tokens and is deterministic."""

from __future__ import annotations

import pytest
import torch

from speculant.bench.llama_server import LlamaServer, llama_server_unavailable

_why = llama_server_unavailable()
pytestmark = [pytest.mark.real,
              pytest.mark.skipif(_why is not None, reason=f"llama-server peer: {_why or ''}")]

TARGET = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def tokenizer():
    """The target's tokenizer: from the converted cache when there is one, else read from the GGUF
    (metadata only: no 30-90 s conversion just for a tokenizer)."""
    from transformers import AutoTokenizer

    from speculant.store.models import PRESETS, cache_dir, gguf_path

    preset = PRESETS[TARGET]
    for cached in sorted((cache_dir() / "models").glob(f"{TARGET}-{preset.sha256[:12]}-*")):
        if (cached / "SPECULANT_COMPLETE.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
    gguf = gguf_path(TARGET)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def server():
    with LlamaServer("plain") as s:
        yield s


def _ids(tokenizer, text: str) -> torch.Tensor:
    from speculant.store.chat import chat_prompt

    return torch.tensor(tokenizer(chat_prompt(tokenizer, text), add_special_tokens=False).input_ids)


def test_plain_stops_at_eos_or_limit_and_is_deterministic(server, tokenizer):
    eos = tokenizer.eos_token_id
    # a reply that ends well within the limit: the last token is EOS
    ids = _ids(tokenizer, "Answer with one word only, no punctuation: what colour is the sky on a clear day?")
    out1, wall1, timing1 = server.run(ids, 24)
    out2, _, _ = server.run(ids, 24)
    assert out1 == out2
    assert 0 < len(out1) < 24 and out1[-1] == eos, tokenizer.decode(out1)
    assert "blue" in tokenizer.decode(out1).lower()
    assert timing1["prompt_n"] == len(ids)  # no prompt cache: every request pays its prefill
    assert wall1 > 0 and timing1["decode_s"] > 0 and timing1["prefill_s"] > 0
    # a long reply is cut at max_new_tokens
    long = _ids(tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    cut1, _, _ = server.run(long, 8)
    cut2, _, _ = server.run(long, 8)
    assert cut1 == cut2 and len(cut1) == 8 and eos not in cut1


@pytest.mark.parametrize("config", ["ngram-mod", "ngram-map-k"])
def test_ngram_modes_run_and_speculate(config, tokenizer):
    """Each of llama.cpp's n-gram modes starts with its own --spec-type and writes the reply."""
    text = "def add(a, b):\n    return a + b\n"
    ids = _ids(tokenizer, f"Repeat this code exactly, with nothing else:\n{text}")
    with LlamaServer(config) as s:
        assert s.args(8080)[s.args(8080).index("--spec-type") + 1] == config
        out, _, timing = s.run(ids, 24)
    assert 0 < len(out) <= 24 and "return a + b" in tokenizer.decode(out)
