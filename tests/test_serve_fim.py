"""Fill in the middle through ``speculant serve``: ``suffix`` on /v1/completions and llama-server's
``/infill`` (streamed and not), on a tiny random model whose vocabulary has Qwen2.5-Coder's FIM
tokens; the prompt is built from those tokens, the greedy output with speculation is plain
decoding's of that prompt, and a model without FIM tokens gets a 400 naming ``suffix``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from speculant import SpeculativeDecoder
from speculant.serve.fim import fim_prompt, fim_tokens
from speculant.serve.infill import Cutter, InfillOptions

from serve_helpers import RunningServer
from tiny import perturbed, tiny_llama, tiny_pair

N = 16
QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]


def fim_tokenizer(marks=QWEN, vocab: int = 64):
    """The tests' word tokenizer with ``marks`` as special tokens at the top of the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3 - len(marks))] + list(marks)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out.add_special_tokens({"additional_special_tokens": list(marks)})
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fim")
    out = {}
    for name, model in (("target", tiny_llama(0, scale=4.0)), ("draft", perturbed(tiny_llama(0, scale=4.0), 0.3))):
        model.generation_config.eos_token_id = 2
        model.save_pretrained(root / name)
        fim_tokenizer().save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _decoder(path: str, method: str, draft: str | None = None, **extra):
    return SpeculativeDecoder(path, draft, method=method, dtype="float32", pacing=False, **extra)


@pytest.fixture(scope="module")
def reference(dirs):
    return _decoder(dirs["target"], "ar")


@pytest.fixture(scope="module")
def server(dirs):
    s = RunningServer(_decoder(dirs["target"], "sd", dirs["draft"], gamma=3))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _plain(reference, prefix: str, suffix: str, middle: str = "", extra=(), n: int = N):
    """Plain greedy decoding of the FIM prompt, ended where the server ends it."""
    fim = fim_tokens(reference.tokenizer, reference.vocab_size)
    ids = fim_prompt(reference.tokenizer, fim, prefix, suffix, middle, extra)
    return ids, reference.generate(ids, n, end_tokens=fim.ends)


def test_the_prompt_is_built_from_the_models_fim_tokens(reference):
    tok = reference.tokenizer
    fim = fim_tokens(tok, reference.vocab_size)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo, fim.file_sep) == (59, 60, 61, 62, 63)
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    assert fim_prompt(tok, fim, "w1 w2", "w3", "w4") == [59, *enc("w1 w2"), 60, *enc("w3"), 61, *enc("w4")]
    repo = fim_prompt(tok, fim, "w1", "w2", extra=[("a.py", "w5 w6")])
    assert repo[0] == 62 and repo.count(63) == 2 and repo[-5:] == [59, *enc("w1"), 60, *enc("w2"), 61]
    # a vocabulary with FIM tokens but no repository tokens: the other files' text comes first, as text
    star = fim_tokenizer(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    fim = fim_tokens(star)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo) == (61, 62, 63, None)
    assert fim_prompt(star, fim, "w1", "w2", extra=[("a.py", "w5")]) == [*star("w5\n").input_ids, 61, 4, 62, 5, 63]
    assert fim_tokens(fim_tokenizer(["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"])).names == ("▁<PRE>", "▁<SUF>", "▁<MID>")
    assert fim_tokens(fim_tokenizer(["<PRE>", "<SUF>"])) is None  # all three are needed


def test_suffix_fills_the_middle_as_plain_decoding_does(client, reference):
    ids, want = _plain(reference, "w1 w2 w3 w1 w2", "w7 w8 w9")
    got = client.completions.create(model="default", prompt="w1 w2 w3 w1 w2", suffix="w7 w8 w9", max_tokens=N,
                                    temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
    spec = got.usage.model_extra["speculative"]
    assert spec["method"] == "sd" and spec["target_calls"] <= len(want.token_ids)
    streamed = client.completions.create(model="default", prompt="w1 w2 w3 w1 w2", suffix="w7 w8 w9", max_tokens=N,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    plain = client.completions.create(model="default", prompt="w1 w2 w3 w1 w2", suffix="", max_tokens=N,
                                      temperature=0)  # an empty suffix: a plain continuation
    assert plain.choices[0].text == reference.generate("w1 w2 w3 w1 w2", N).text


def test_a_model_without_fim_tokens_refuses_suffix(tmp_path):
    s = RunningServer(_decoder(tiny_pair(tmp_path)["target"], "ar"))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="default", prompt="w1 w2", suffix="w3", max_tokens=4)
        assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.body["message"]
        r = s.post("/infill", {"input_prefix": "w1", "input_suffix": "w2"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    finally:
        s.stop()


INFILL = {"input_prefix": "w1 w2 w3", "input_suffix": "w8 w9", "prompt": "w4",
          "input_extra": [{"filename": "util.py", "text": "w1 w2 w3 w4 w5"}], "n_predict": N, "temperature": 0,
          "cache_prompt": True, "t_max_prompt_ms": 500, "samplers": ["top_k", "top_p", "infill"]}


def test_infill_answers_as_llama_server(server, reference):
    ids, want = _plain(reference, "w1 w2 w3", "w8 w9", "w4", [("util.py", "w1 w2 w3 w4 w5")])
    got = server.post("/infill", {**INFILL, "return_tokens": True}).json()
    assert got["content"] == want.text and got["stop"] is True and got["tokens"] == want.token_ids
    assert got["stop_type"] == ("eos" if want.finish_reason == "eos" else "limit")
    assert got["tokens_evaluated"] == len(ids) and got["tokens_predicted"] == len(want.token_ids)
    assert got["timings"]["predicted_n"] == len(want.token_ids) and got["speculative"]["method"] == "sd"
    assert got["timings"]["cache_n"] == got["tokens_cached"] and got["timings"]["prompt_n"] == len(ids) - got["tokens_cached"]
    fields = ["content", "timings/prompt_n", "timings/cache_n", "nothing/here"]
    picked = server.post("/infill", {**INFILL, "response_fields": fields}).json()
    assert set(picked) == {"content", "timings/prompt_n", "timings/cache_n"} and picked["content"] == want.text
    assert picked["timings/prompt_n"] + picked["timings/cache_n"] == len(ids)  # the second time from the cache

    events = []
    with httpx.stream("POST", server.url + "/infill", json={**INFILL, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == want.text
    assert [t for e in events[:-1] for t in e["tokens"]] == want.token_ids


@pytest.mark.parametrize("field, value", [("n_predict", "8"), ("n_predict", -2), ("input_extra", [{"text": 3}]),
                                          ("input_extra", {"filename": "a"}), ("input_prefix", 5), ("temperature", 3),
                                          ("mirostat", 2), ("n_indent", -1), ("response_fields", "content"),
                                          ("samplers", "top_k"), ("stop", [""]), ("top_p", 0)])
def test_bad_infill_fields_are_a_400_naming_them(server, field, value):
    r = server.post("/infill", {**INFILL, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split("[")[0] == field


def test_n_indent_and_the_time_limit_end_the_middle():
    cut = Cutter(InfillOptions(n_indent=4))
    kept = "".join(cut.feed(p) for p in ["x = 1\n", "    y", " = 2\n", "\n", "  ", "z = 3\n", "w"])
    assert kept + cut.rest() == cut.text == "x = 1\n    y = 2\n\n" and cut.done  # "  z", indented 2 < 4, is cut
    first = Cutter(InfillOptions(n_indent=4))
    assert first.feed("z = 1") == "z = 1" and not first.done  # the first line's indentation does not count
    slow = Cutter(InfillOptions(t_max_predict_ms=1e-6))
    assert slow.feed("a") == "a" and not slow.done  # no newline yet
    assert slow.feed("b\nc") == "b\nc" and slow.done
