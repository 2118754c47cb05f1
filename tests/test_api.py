"""The Python API on tiny model directories: a SpeculativeDecoder built from a DecoderConfig or from
keyword options, clear errors for bad options, and generation (every method's greedy output equal
to plain decoding's; streaming equal to generating)."""

from __future__ import annotations

import dataclasses

import pytest

import speculant
from speculant import ConfigError, DecoderConfig, SpeculativeDecoder
from speculant.tuning.costmodel import PassCost
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter

from tiny import tiny_pair

PROMPT = "w1 w2 w3 w4 w1 w2 w3"
FLAT = PassCost((1, 64), (100.0, 100.0))  # a pass costs the same at any width: no measuring in tests


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def plain(dirs):
    return SpeculativeDecoder(dirs["target"], method="ar", dtype="float32")


def test_config_and_keyword_options_build_the_same_decoder(dirs):
    config = DecoderConfig(dirs["target"], dirs["draft"], method="sd", gamma=3, dtype="float32")
    a, b = SpeculativeDecoder(config), SpeculativeDecoder(dirs["target"], dirs["draft"], method="sd", gamma=3,
                                                          dtype="float32")
    assert a.config == b.config
    assert (a.method, a.gamma, a.backend, a.config.target_quant) == ("sd", 3, "hf", "none")  # float32: transformers
    assert a.generate(PROMPT, 12).token_ids == b.generate(PROMPT, 12).token_ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.config.gamma = 5


def test_config_normalizes_and_resolves(dirs):
    config = DecoderConfig(dirs["target"], method="mcsd", draft=dirs["draft"], tree=[[0], [1], [0, 0]],
                           acceptance="topk=2")
    assert config.tree == ((0,), (1,), (0, 0))  # a list of paths kept as tuples: the config is hashable data
    assert config.acceptance.rule == "topk" and config.acceptance.k_top == 2
    dec = SpeculativeDecoder(dataclasses.replace(config, acceptance="exact", dtype="float32"))
    assert dec.tree.size == 4 and dec.config.gamma == 4 and dec.config.quant_head is False


def test_auto_method_follows_what_is_given(dirs):
    with_draft = SpeculativeDecoder(dirs["target"], dirs["draft"], dtype="float32")
    assert with_draft.method == "sd" and "sd" in with_draft.why
    plain = SpeculativeDecoder(dirs["target"], method="ar", dtype="float32").generate("w1 w2 w3", 8)
    assert with_draft.draft is not None  # loaded for the method auto chose
    assert with_draft.generate("w1 w2 w3", 8).token_ids == plain.token_ids
    alone = SpeculativeDecoder(dirs["target"], dtype="float32", tree_budget=FLAT)
    assert alone.method == "lookup" and alone.gamma == 8 and alone.sizer is not None  # no heads ship for it
    assert "lookup" in alone.why and "transformers" in alone.why
    fixed = SpeculativeDecoder(dirs["target"], dtype="float32", tree_budget="fixed")
    assert fixed.gamma == 4 and fixed.sizer is None


def test_each_generation_gets_a_fresh_drafter(dirs):
    kinds = {"ar": NoDrafter, "lookup": LookupDrafter, "sd": DraftModelDrafter}
    for method, kind in kinds.items():
        dec = SpeculativeDecoder(dirs["target"], dirs["draft"] if method == "sd" else None, method=method,
                                 dtype="float32", tree_budget="fixed")
        first, second = dec._drafter(speculant.SamplingConfig(), None), dec._drafter(speculant.SamplingConfig(), None)
        assert isinstance(first, kind) and first is not second


@pytest.mark.parametrize("method, extra", [("sd", {"gamma": 2}), ("mcsd", {"tree": "2x2x1"}),
                                           ("mcsd", {"tree": "3x1", "replacement": False}),
                                           ("lookup", {"gamma": 5, "tree_budget": "fixed"}),
                                           ("lookup", {"tree_budget": FLAT})])
def test_generate_greedy_equals_plain(dirs, plain, method, extra):
    dec = SpeculativeDecoder(dirs["target"], dirs["draft"] if method in ("sd", "mcsd") else None, method=method,
                             dtype="float32", **extra)
    ref = plain.generate(PROMPT, 16)
    got = dec.generate(PROMPT, 16)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert got.prompt_tokens == 7 and got.finish_reason in ("eos", "length")
    assert got.stats.new_tokens == len(got.token_ids) and got.stats.target_calls >= 1


def test_stream_matches_generate_and_the_convenience_function(dirs, plain):
    dec = SpeculativeDecoder(dirs["target"], dirs["draft"], method="sd", gamma=3, dtype="float32", pacing=False)
    events = list(dec.stream(PROMPT, 12))
    result = dec.generate(PROMPT, 12)
    assert [e.token_id for e in events] == result.token_ids
    assert {e.source for e in events} <= {"draft", "target"}
    assert dec.last_finish_reason == result.finish_reason
    one_shot = speculant.generate(PROMPT, dirs["target"], dirs["draft"], method="sd", gamma=3, dtype="float32",
                                  max_new_tokens=12)
    assert one_shot.token_ids == result.token_ids == plain.generate(PROMPT, 12).token_ids


def test_sampled_generation_is_reproducible_with_a_seed(dirs):
    dec = SpeculativeDecoder(dirs["target"], dirs["draft"], method="sd", gamma=3, dtype="float32")
    a = dec.generate(PROMPT, 12, temperature=0.8, top_p=0.9, seed=5)
    assert a.token_ids == dec.generate(PROMPT, 12, temperature=0.8, top_p=0.9, seed=5).token_ids


@pytest.mark.parametrize("options, message", [
    ({"methd": "ar"}, "unknown option 'methd' \\(did you mean 'method'\\?\\)"),
    ({"method": "eagle3"}, "unknown method 'eagle3': choose one of auto, ar, sd"),
    ({"method": "eagle", "tree": "2x2"}, "method 'eagle' grows its tree at every step"),
    ({"backend": "onnx"}, "unknown backend 'onnx': choose one of auto, hf, native"),
    ({"method": "sd"}, "needs a draft model: pass draft="),
    ({"method": "lookup", "gamma": 0}, "gamma \\(draft length\\) must be between 1 and 64"),
    ({"method": "lookup", "lookup_branch": 4}, "lookup_branch=4: .* 'medusa', 'hydra' and 'eagle' only"),
    ({"method": "lookup", "tree": "dynamic:8"}, "grown from heads: use --method hydra or medusa"),
    ({"method": "ar", "tree": "4y2"}, "malformed tree spec '4y2'"),
    ({"method": "hydra", "tree": "dynamic:x"}, "malformed dynamic tree"),
    ({"tree_budget": "big"}, "unknown tree budget 'big': choose 'auto'"),
    ({"backend": "hf", "target_quant": "int4"}, "runs on the native backend: pass backend='native'"),
    ({"target_quant": "int3"}, "unknown target quantization 'int3'"),
    ({"draft_quant": "fp8"}, "unknown quantization 'fp8'"),
    ({"acceptance": "typical=2"}, "typical acceptance eps must be in \\(0, 1\\)"),
    ({"acceptance": "fuzzy"}, "cannot read acceptance rule 'fuzzy'"),
])
def test_bad_options_say_what_to_change(dirs, options, message):
    with pytest.raises(ConfigError, match=message):
        DecoderConfig.from_options(dirs["target"], **options)
    with pytest.raises(ConfigError, match=message):  # the decoder fails the same way, before loading anything
        SpeculativeDecoder(dirs["target"], **options)


def test_errors_found_while_building(dirs):
    with pytest.raises(ConfigError, match="runs on the native backend"):  # auto picks transformers for float32
        SpeculativeDecoder(dirs["target"], method="ar", target_quant="int8", dtype="float32")
    with pytest.raises(ConfigError, match="needs medusa heads and none ship for .*: pass heads=DIR"):
        SpeculativeDecoder(dirs["target"], method="medusa", dtype="float32")
    with pytest.raises(ConfigError, match="method 'eagle' needs an EAGLE drafter and none ships .*: pass heads=DIR"):
        SpeculativeDecoder(dirs["target"], method="eagle", dtype="float32")
    with pytest.raises(ConfigError, match="pass either a DecoderConfig or a target with keyword options"):
        SpeculativeDecoder(DecoderConfig(dirs["target"]), method="ar")
    with pytest.raises(ConfigError, match="unsupported dtype"):
        SpeculativeDecoder(dirs["target"], method="ar", dtype="float8")


def test_bad_prompts(plain):
    with pytest.raises(ConfigError, match="the prompt is empty"):
        plain.generate("   ", 4)
    with pytest.raises(ConfigError, match="the prompt is empty"):
        plain.generate([], 4)
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        plain.generate(PROMPT, 0)


CHAT = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}<assistant>"
NOT_TEXT = [  # (where, prompt or messages, stop, message)
    ("prompt", "\ud800 w1 w2", None,
     "the prompt has a lone surrogate U\\+D800 at character 0: give valid Unicode text"),
    ("prompt", "w1 w2 \udcff", None, "lone surrogate U\\+DCFF at character 6 \\(the byte 0xFF, which is not UTF-8\\)"),
    ("prompt", "w1 \ud83d\ude00", None, "surrogate pair U\\+D83D U\\+DE00 at character 3: .* U\\+1F600 itself"),
    ("prompt", "w1 \x00 w2", None, "the prompt has a NUL character \\(U\\+0000\\) at character 3"),
    ("messages", [{"role": "user", "content": "w1 \udc80"}], None, "messages\\[0\\] \\(user\\) content has a lone"),
    ("system prompt", [{"role": "system", "content": "w3\x00"}, {"role": "user", "content": "w1"}], None,
     "messages\\[0\\] \\(system\\) content has a NUL character"),
    ("stop", PROMPT, "w5\ud801", "the stop string has a lone surrogate U\\+D801 at character 2"),
    ("stops", PROMPT, ["w5", "\x00"], "stop string 1 has a NUL character"),
    ("token ids", [3, 64, 5], None, "token id 64 is outside the vocabulary \\(ids 0 to 63\\)"),
    ("token ids", [-1, 5], None, "token id -1 is outside the vocabulary"),
]


@pytest.mark.parametrize("method", ["ar", "lookup"])
def test_text_that_is_not_valid_unicode_is_refused_and_the_decoder_stays_usable(dirs, method):
    """Invalid text anywhere a model reads it (prompt, chat messages, system prompt, stop strings)
    or token ids outside the vocabulary: a ConfigError that says what and where, from generate,
    stream and a batch alike, before any pass; the next generation is the usual one."""
    from speculant.text_check import check_text

    dec = SpeculativeDecoder(dirs["target"], method=method, dtype="float32", tree_budget="fixed")
    dec.tokenizer.chat_template = CHAT
    want = dec.generate(PROMPT, 8).token_ids
    chat = dec.generate([{"role": "user", "content": "w1 w2"}], 8).token_ids
    for where, prompt, stop, message in NOT_TEXT:
        with pytest.raises(ConfigError, match=message):
            dec.generate(prompt, 8, stop=stop)
        with pytest.raises(ConfigError, match=message):
            next(dec.stream(prompt, 8, stop=stop))
        if where == "prompt":
            with pytest.raises(ConfigError, match=message):
                dec.generate([PROMPT, prompt], 8)  # a batch: checked before any sequence runs
        assert dec.generate(PROMPT, 8).token_ids == want, where
    assert dec.generate([{"role": "user", "content": "w1 w2"}], 8).token_ids == chat
    assert check_text("w1 é 漢字 \U0001F600") == "w1 é 漢字 \U0001F600"  # valid text passes as it is
