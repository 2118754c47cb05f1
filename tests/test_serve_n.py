"""``n`` > 1 in ``speculant serve``: n generations of the batch, through the ``openai`` client.
Choice i of a request with ``seed`` s is the one-choice request with seed s + i (greedy: all equal
plain decoding); the stream interleaves the choices' chunks by ``index``, each choice adds up to
its non-streamed text and ends with its own finish chunk; usage counts the prompt once."""

from __future__ import annotations

import openai
import pytest

from speculant import SpeculativeDecoder
from speculant.serve.app import choice_seed

from serve_helpers import CHAT_TEMPLATE, RunningServer
from tiny import tiny_llama, tiny_model_dir

MESSAGES = [{"role": "user", "content": "w3 w4 w5 w3 w4"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("n")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3)
    dec = SpeculativeDecoder(str(target), str(draft), method="sd", dtype="float32", pacing=False, gamma=3)
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    server = RunningServer(dec, max_queue=32)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.stop()


def test_greedy_choices_are_all_plain_decoding(served):
    one = served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12, temperature=0)
    three = served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_sampled_choice_i_is_the_request_with_seed_plus_i(served):
    many = served.completions.create(model="default", prompt="w1 w2 w3", max_tokens=10, temperature=1.0, seed=41,
                                     n=4)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    for i, text in enumerate(texts):
        alone = served.completions.create(model="default", prompt="w1 w2 w3", max_tokens=10, temperature=1.0,
                                          seed=41 + i)
        assert alone.choices[0].text == text
    assert len(set(texts)) > 1  # the seeds differ, so (almost surely) do the samples


def test_streamed_choices_add_up_to_the_whole_ones(served):
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=10, temperature=0.8, seed=7, n=2)
    whole = served.chat.completions.create(**kwargs)
    chunks = list(served.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_choice_seeds_wrap_in_64_bits():
    assert choice_seed(None, 3) is None
    assert choice_seed(5, 2) == 7
    assert choice_seed(2**63 - 1, 1) == -(2**63)
