"""/v1/completions prompts in every form OpenAI takes (a list of strings, token ids, lists of token
ids) and ``prediction`` (Predicted Outputs) on both endpoints, through the real ``openai`` client
on tiny random models: each choice is what plain greedy decoding of its prompt gives, a prediction
changes nothing in the text and, equal to the output, is accepted in fewer target passes; bad
values are a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from serve_helpers import client, dirs, reference, server  # noqa: F401 (the fixtures)

N = 16
MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]


def _complete(client, **fields):
    return client.completions.create(model="default", max_tokens=N, temperature=0, **fields)


def test_a_list_of_prompts_is_a_batch_with_one_choice_each_in_order(client, reference):
    prompts = ["w1 w2 w3", "w9 w8 w7 w9 w8", "w5"]
    want = [reference.generate(p, N) for p in prompts]
    got = _complete(client, prompt=prompts)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    two = _complete(client, prompt=prompts[:2], n=2)  # n choices per prompt: prompt i's at i * n ...
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [want[0].text] * 2 + [want[1].text] * 2
    streamed = _complete(client, prompt=prompts, stream=True)
    texts = [""] * 3
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [w.text for w in want]


def test_token_id_prompts_are_decoded_as_their_ids(client, reference):
    ids = [reference.encode(p).tolist() for p in ("w1 w2 w3", "w4 w4 w5 w6")]
    want = [reference.generate(i, N) for i in ids]
    one = _complete(client, prompt=ids[0])
    assert one.choices[0].text == want[0].text and one.usage.prompt_tokens == len(ids[0])
    both = _complete(client, prompt=ids)
    assert [c.text for c in both.choices] == [w.text for w in want]
    echoed = _complete(client, prompt=ids[1], echo=True, logprobs=0)
    assert echoed.choices[0].text == reference.tokenizer.decode(ids[1]) + want[1].text
    assert len(echoed.choices[0].logprobs.tokens) == len(ids[1]) + len(want[1].token_ids)


@pytest.mark.parametrize("prompt, param", [([], "prompt"), ([1, 2, 10_000], "prompt"), ([[1, 2], [3, 99]], "prompt[1]"),
                                           ([[]], "prompt[0]"), (["w1", [1, 2]], "prompt[1]"), ([1, "w1"], "prompt[1]"),
                                           ([1, -2], "prompt"), ([True], "prompt[0]"), (["w1", ""], "prompt[1]"),
                                           ([{"text": "w1"}], "prompt[0]"), (["w1"] * 65, "prompt")])
def test_bad_prompts_are_a_400_naming_the_prompt(client, prompt, param):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, prompt=prompt)
    assert e.value.body["param"] == param, e.value.body


def test_more_generations_than_the_queue_holds_is_a_400(client, server):
    prompts = server.config.max_queue // 4 + 1  # x n=4: more generations than the server's queue holds
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, prompt=["w1"] * prompts, n=4)
    assert e.value.body["param"] == "prompt" and "--max-queue" in e.value.body["message"]


def _prediction_usage(usage) -> tuple[int, int, int]:
    details = usage.completion_tokens_details
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens, \
        usage.model_extra["speculative"]["target_calls"]


def test_a_prediction_changes_nothing_but_the_passes(client, reference):
    want = reference.generate(MESSAGES, N)
    alone = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0)
    assert alone.choices[0].message.content == want.text and alone.usage.completion_tokens_details is None
    exact = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                           prediction={"type": "content", "content": want.text})
    assert exact.choices[0].message.content == want.text
    accepted, rejected, calls = _prediction_usage(exact.usage)
    assert accepted > 0 and calls < alone.usage.model_extra["speculative"]["target_calls"]
    parts = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=N, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": "w40 w41 "}, {"type": "text",
                                                                                          "text": "w42 w43"}]})
    assert parts.choices[0].message.content == want.text
    streamed = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                                   prediction={"type": "content", "content": want.text}, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    assert _prediction_usage(streamed[-1].usage)[0] == accepted

    text = reference.generate("w3 w4 w5 w3", N)
    completed = _complete(client, prompt="w3 w4 w5 w3", extra_body={"prediction": {"type": "content",
                                                                                "content": text.text}})
    assert completed.choices[0].text == text.text and _prediction_usage(completed.usage)[0] > 0


@pytest.mark.parametrize("prediction, param", [("w1 w2", "prediction"), ({"type": "text", "content": "w1"}, "prediction"),
                                               ({"type": "content"}, "prediction.content"),
                                               ({"type": "content", "content": 5}, "prediction.content"),
                                               ({"type": "content", "content": [{"type": "image"}]},
                                                "prediction.content[0]"),
                                               ({"type": "content", "content": "w1", "extra": 1}, "prediction")])
def test_bad_predictions_are_a_400_naming_the_field(client, prediction, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, prediction=prediction)
    assert e.value.body["param"] == param, e.value.body
