"""Stop strings, cancellation and chat messages in the engine (``SpeculativeDecoder.generate``,
``.stream``, ``.start``): greedy output with stop strings equals plain greedy output cut at the same
place for every exact method, wherever the stop string falls (inside a token, across tokens, inside
one accepted speculative block); streamed text never shows a stop string's start and adds up to the
generated text."""

from __future__ import annotations

import pytest

from speculant import ConfigError, SpeculativeDecoder
from speculant.tuning.costmodel import PassCost
from speculant.heads import HeadsConfig, MedusaHeads, save_heads
from speculant.stopping import StopStrings, parse_stop

from tiny import tiny_pair

PROMPT = "w1 w2 w3 w4 w1 w2 w3"
N = 24
FLAT = PassCost((1, 64), (100.0, 100.0))
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def plain(dirs):
    return SpeculativeDecoder(dirs["target"], method="ar", dtype="float32")


@pytest.fixture(scope="module")
def decoders(dirs, plain):
    heads_dir = dirs["root"] / "heads"
    lm = plain.target
    save_heads(MedusaHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim),
                           lm.model.get_output_embeddings()), heads_dir)
    common = {"dtype": "float32", "pacing": False}
    return {
        "ar": plain,
        "sd": SpeculativeDecoder(dirs["target"], dirs["draft"], method="sd", gamma=4, **common),
        "mcsd": SpeculativeDecoder(dirs["target"], dirs["draft"], method="mcsd", tree="2x2x1", **common),
        "lookup": SpeculativeDecoder(dirs["target"], method="lookup", gamma=6, tree_budget="fixed", **common),
        "medusa": SpeculativeDecoder(dirs["target"], method="medusa", heads=str(heads_dir), tree_budget=FLAT,
                                     **common),
    }


# ---- the matcher -----------------------------------------------------------------------------

def test_parse_stop_accepts_none_a_string_or_up_to_four_strings():
    assert parse_stop(None) == () and parse_stop("x") == ("x",) and parse_stop(["a", "b"]) == ("a", "b")
    with pytest.raises(ConfigError, match="at most 4 stop strings"):
        parse_stop(["a", "b", "c", "d", "e"])
    with pytest.raises(ConfigError, match="a stop string is empty"):
        parse_stop(["a", ""])
    with pytest.raises(ConfigError, match="must be a string"):
        parse_stop(["a", 3])
    with pytest.raises(ConfigError, match="string or a list"):
        parse_stop(7)


def test_scan_finds_the_earliest_stop_and_looks_only_at_new_text():
    stops = StopStrings(("cd", "bc", "zz"))
    assert stops.scan("abcde") == 1  # "bc" starts before "cd"
    assert stops.scan("xxab", 0) is None
    assert stops.scan("xxabc", checked=4) == 3  # completed by the new "c", started in the old text
    assert stops.scan("zzab", checked=4) is None  # an old match is not looked for again
    assert stops.scan("") is None and StopStrings(()).scan("anything") is None


def test_safe_length_holds_back_only_a_possible_start_of_a_stop():
    stops = StopStrings(("w5 w6", "end"))
    assert stops.safe_length("w1 w5") == 3  # "w5" may grow into "w5 w6"
    assert stops.safe_length("w1 w5 ") == 3
    assert stops.safe_length("w1 w5 w7") == 8  # it did not: everything can be shown
    assert stops.safe_length("the en") == 4
    assert stops.safe_length("w1 w2") == 5
    assert StopStrings(()).safe_length("abc") == 3


# ---- end to end: greedy with stop strings == plain greedy cut ----------------------------------

def _stops_in(text: str) -> list[str]:
    """Stop strings at several places in ``text``: whole words, across a word boundary, inside a
    word, spanning three words."""
    words = text.split(" ")
    assert len(words) >= 8, text
    out = []
    for k in (0, 2, 4, 6):
        out.append(" ".join(words[k:k + 2]))  # across tokens
        out.append(words[k][-1:] + " " + words[k + 1][:2])  # the end of one token, the start of the next
    out.append(words[1][1:])  # inside one token
    out.append(" ".join(words[3:6]))  # three tokens
    return out


@pytest.mark.parametrize("method", ["ar", "sd", "mcsd", "lookup", "medusa"])
def test_greedy_with_stop_equals_plain_greedy_cut(decoders, plain, method):
    ref = plain.generate(PROMPT, N)
    dec = decoders[method]
    for stop in _stops_in(ref.text):
        cut = ref.text[:ref.text.find(stop)]
        got = dec.generate(PROMPT, N, stop=[stop, "never-appears"])
        assert got.text == cut, (method, stop)
        assert got.finish_reason == "stop"
        # every token up to the one that completed the stop string, and no more
        assert got.token_ids == ref.token_ids[:len(got.token_ids)]
        before = plain.tokenizer.decode(got.token_ids[:-1], skip_special_tokens=True)
        assert stop not in before and stop in plain.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        streamed = list(dec.stream(PROMPT, N, stop=stop))
        assert "".join(e.text for e in streamed) == cut
        assert [e.token_id for e in streamed] == got.token_ids


def test_decoding_stops_early_at_a_stop_string(decoders, plain):
    ref = plain.generate(PROMPT, N)
    first = ref.text.split(" ")[1]
    got = decoders["sd"].generate(PROMPT, N, stop=" " + first)
    assert got.finish_reason == "stop" and len(got.token_ids) <= 3
    assert got.stats.new_tokens < N and got.stats.target_calls <= 3


def test_a_stop_string_that_never_occurs_changes_nothing(decoders, plain):
    ref = plain.generate(PROMPT, N)
    for method, dec in decoders.items():
        got = dec.generate(PROMPT, N, stop=["zzz", "w999"])
        assert (got.text, got.token_ids, got.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason), method


def test_streamed_text_never_shows_the_start_of_a_stop_string(decoders, plain):
    ref = plain.generate(PROMPT, N)
    words = ref.text.split(" ")
    stop = words[5] + " w999"  # its first part occurs, the whole never does
    shown = ""
    for event in decoders["sd"].stream(PROMPT, N, stop=stop):
        shown += event.text
        assert shown == ref.text[:len(shown)]
    assert shown == ref.text  # released at the end


# ---- cancellation ---------------------------------------------------------------------------

def test_cancel_ends_the_generation_after_the_current_step(decoders):
    dec = decoders["sd"]
    steps = {"n": 0}

    def cancel():
        steps["n"] += 1  # polled once per step
        return steps["n"] >= 2

    gen = dec.start(PROMPT, N, cancel=cancel)
    events = list(gen)
    assert gen.finish_reason == "cancelled" and steps["n"] == 2
    assert gen.stats.target_calls == 2 and len(events) == len(gen.token_ids) < N
    assert "".join(e.text for e in events) == gen.text


# ---- chat messages ----------------------------------------------------------------------------

def test_messages_use_the_chat_template(dirs, plain):
    tok = plain.tokenizer
    tok.chat_template = TEMPLATE
    try:
        messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]
        ids = plain.encode(messages)
        assert ids.tolist() == tok("<system>w1<user>w2 w3<assistant>", add_special_tokens=False).input_ids
        got = plain.generate(messages, 8)
        assert got.token_ids == plain.generate(ids, 8).token_ids and got.prompt_tokens == len(ids)
        for bad, message in [
            ([{"role": "robot", "content": "w1"}], r"role 'robot': use one of system, user, assistant"),
            ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
            ([{"role": "user"}], r"messages\[0\].content must be a string"),
        ]:
            with pytest.raises(ConfigError, match=message):
                plain.generate(bad, 4)
    finally:
        tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template.*plain text prompt"):
        plain.generate([{"role": "user", "content": "w1"}], 4)
