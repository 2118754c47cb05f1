"""Thinking models in ``speculant serve``: ``chat_template_kwargs`` reaching the chat template,
``reasoning_effort`` mapped onto its ``enable_thinking`` switch, and the thinking written between
``<think>`` and ``</think>`` coming back as ``reasoning_content``, streamed and not, with tool
calls parsed from the answer only, and given back with a reply for the template; every bad value
a 400 naming the field; a model without a thinking template unchanged. The templates are minimal
Qwen3-style ones written here. Most tests serve a byte-level tokenizer (every text round-trips)
with a scripted scheduler that sends a given completion token by token and records the prompt;
one serves a tiny random model whose greedy output closes its thinking, and shows the output is
plain greedy decoding's, only split."""

from __future__ import annotations

import random
import re

import openai
import pytest

from speculant import SpeculativeDecoder
from speculant.serve.reasoning import ReasoningStream, split
from speculant.store.chat import chat_messages_prompt

from serve_helpers import RunningServer, scripted_server
from tiny import tiny_model_dir

# Qwen3's switch: thinking unless enable_thinking is false, which writes an empty thinking itself
QWEN3 = ("{% if tools %}<|im_start|>system\nCall a tool as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
         "</tool_call>:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
         "{% if system_note is defined %}<|im_start|>system\n{{ system_note }}<|im_end|>\n{% endif %}"
         "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
         "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
         "{% endif %}")
# a template that opens the thinking in the generation prompt: the model writes only its end
OPENED = QWEN3.replace("{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                       "{% endif %}", "<think>\n{% if enable_thinking is defined and enable_thinking is false %}"
                                      "\n</think>\n\n{% endif %}")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def byte_tokenizer(template: str):
    """A byte-level tokenizer (any text round-trips) with Qwen's tags as tokens, and ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"])
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.chat_template = template
    return fast


def _served(template: str):
    tokenizer = byte_tokenizer(template)
    served = scripted_server(tokenizer)
    served.tokenizer = tokenizer
    return served


@pytest.fixture(scope="module")
def qwen3():
    served = _served(QWEN3)
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def opened():
    served = _served(OPENED)
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def plain():
    served = _served(PLAIN)
    yield served
    served.server.stop()


def _ask(served, text: str, **fields):
    """The scripted server's non-streamed reply to MESSAGES when the model writes ``text``, and
    the prompt it was given (decoded)."""
    served.script.update(text=text, reason="eos")
    extra = {k: fields.pop(k) for k in ("chat_template_kwargs", "reasoning_effort") if k in fields}
    fields.setdefault("messages", MESSAGES)
    reply = served.client.chat.completions.create(model="default", extra_body=extra, **fields)
    return reply, served.tokenizer.decode(served.scheduler.jobs[-1].prompt)


def _stream(served, text: str, **fields) -> tuple[list[tuple[str, str]], str | None]:
    """The streamed reply's deltas as (kind, text) in order, kind "reasoning" or "content", and
    its last finish reason."""
    served.script.update(text=text, reason="eos")
    chunks = list(served.client.chat.completions.create(model="default", messages=MESSAGES, stream=True,
                                                        **fields))
    out = []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            out.append(("reasoning", delta.reasoning_content))
        if delta.content:
            out.append(("content", delta.content))
    return out, chunks[-1].choices[0].finish_reason


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _whole(text: str, reasoning: str, content: str) -> bool:
    """Whether ``text`` is the thinking and the answer with nothing lost but the tags and the
    whitespace around them."""
    pattern = r"\s*(<think>)?\s*" + re.escape(reasoning) + r"\s*</think>\s*" + re.escape(content)
    return re.fullmatch(pattern, text) is not None


# --- the splitter ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, opened, want", [
    (THOUGHT, False, ("Let me see: 2 + 2.", "It is 4.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),
    ("It is 4.", False, ("", "It is 4.")),  # no thinking: all content, unchanged
    ("  <thinking> is a word\n", False, ("", "  <thinking> is a word\n")),
    ("a </think> b", False, ("", "a </think> b")),
    ("<think>\ncut short by max_tokens </thi", False, ("cut short by max_tokens </thi", "")),
    ("<think>\n\n</think>\n\n", False, ("", "")),
    ("", False, ("", "")),
    ("<thi", False, ("", "<thi")),
])
def test_the_split_is_the_same_for_every_way_the_text_comes(text, opened, want):
    assert split(text, opened) == want
    for seed in range(40):
        r, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            j = i + r.randint(1, 5)
            pieces.append(text[i:j])
            i = j
        s = ReasoningStream(opened)
        deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
        kinds = [next(iter(d)) for d in deltas]
        assert kinds == sorted(kinds, key=lambda k: k == "content")  # thinking first, then the answer
        assert ("".join(d.get("reasoning_content", "") for d in deltas),
                "".join(d.get("content", "") for d in deltas)) == want


# --- the template's variables ------------------------------------------------------------------

def test_enable_thinking_changes_the_rendered_prompt_as_the_template_says(qwen3):
    _, default = _ask(qwen3, "x")
    assert default.endswith("<|im_start|>assistant\n")
    _, off = _ask(qwen3, "x", chat_template_kwargs={"enable_thinking": False})
    assert off == default + "<think>\n\n</think>\n\n"
    _, on = _ask(qwen3, "x", chat_template_kwargs={"enable_thinking": True})
    assert on == default
    _, null = _ask(qwen3, "x", chat_template_kwargs={"enable_thinking": None})  # null: as if absent
    assert null == default
    _, noted = _ask(qwen3, "x", chat_template_kwargs={"system_note": "Be brief.", "enable_thinking": False})
    assert noted == "<|im_start|>system\nBe brief.<|im_end|>\n" + off  # any variable the template reads


def test_reasoning_effort_maps_onto_enable_thinking(qwen3, opened):
    for served in (qwen3, opened):
        _, on = _ask(served, "x", chat_template_kwargs={"enable_thinking": True})
        _, off = _ask(served, "x", chat_template_kwargs={"enable_thinking": False})
        assert on != off
        for effort in ("none", "minimal"):
            assert _ask(served, "x", reasoning_effort=effort)[1] == off, effort
        for effort in ("low", "medium", "high"):
            assert _ask(served, "x", reasoning_effort=effort)[1] == on, effort
        # with an enable_thinking that agrees, or null
        assert _ask(served, "x", reasoning_effort="none", chat_template_kwargs={"enable_thinking": False})[1] == off
        assert _ask(served, "x", reasoning_effort="high", chat_template_kwargs={"enable_thinking": None})[1] == on


# --- reasoning_content -------------------------------------------------------------------------

def test_the_thinking_comes_back_as_reasoning_content(qwen3):
    reply, _ = _ask(qwen3, THOUGHT)
    message = reply.choices[0].message
    assert (_reasoning(message), message.content) == ("Let me see: 2 + 2.", "It is 4.")
    assert reply.choices[0].finish_reason == "stop" and _whole(THOUGHT, _reasoning(message), message.content)
    deltas, finish = _stream(qwen3, THOUGHT)
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(set(kinds)) == 2 and finish == "stop"
    assert len(deltas) > 4  # sent as it comes, not at the end
    assert "".join(t for k, t in deltas if k == "reasoning") == _reasoning(message)
    assert "".join(t for k, t in deltas if k == "content") == message.content


def test_a_template_that_opens_the_thinking_has_the_completion_start_inside_it(opened):
    text = "Let me see: 2 + 2.\n</think>\n\nIt is 4."
    reply, prompt = _ask(opened, text)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    message = reply.choices[0].message
    assert (_reasoning(message), message.content) == ("Let me see: 2 + 2.", "It is 4.")
    deltas, _ = _stream(opened, text)
    assert [k for k, _ in deltas][0] == "reasoning"
    assert "".join(t for k, t in deltas if k == "reasoning") == "Let me see: 2 + 2."
    assert "".join(t for k, t in deltas if k == "content") == "It is 4."
    # thinking switched off: the template closes it, and what the model writes is the answer
    reply, prompt = _ask(opened, "It is 4.", reasoning_effort="none")
    assert prompt.endswith("assistant\n<think>\n</think>\n\n") and reply.choices[0].message.content == "It is 4."
    assert _reasoning(reply.choices[0].message) is None


def test_an_answer_without_thinking_is_all_content(qwen3):
    for text in ("It is 4.", "  It is <think> 4.", ""):
        reply, _ = _ask(qwen3, text)
        assert reply.choices[0].message.content == text and _reasoning(reply.choices[0].message) is None
        deltas, _ = _stream(qwen3, text)
        assert all(k == "content" for k, _ in deltas) and "".join(t for _, t in deltas) == text


def test_thinking_cut_short_is_all_reasoning(qwen3):
    qwen3.script.update(text="<think>\nLet me see", reason="length")
    reply = qwen3.client.chat.completions.create(model="default", messages=MESSAGES)
    message = reply.choices[0].message
    assert (_reasoning(message), message.content, reply.choices[0].finish_reason) == ("Let me see", "", "length")


def test_tool_calls_are_parsed_from_the_answer_only(qwen3):
    text = f"<think>\nI could write {CALL} but first a word.\n</think>\n\nLooking it up.\n{CALL}"
    reply, prompt = _ask(qwen3, text, tools=[WEATHER])
    assert "get_weather" in prompt  # the tools and the thinking switch go through the one template
    message = reply.choices[0].message
    assert _reasoning(message) == f"I could write {CALL} but first a word."
    assert message.content == "Looking it up." and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    qwen3.script.update(text=text, reason="eos")
    chunks = list(qwen3.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER],
                                                       stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert (reasoning, content) == (_reasoning(message), "Looking it up.")
    assert [t.function.name for t in calls if t.id] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # with the thinking switched off, a call written first is still a call
    reply, _ = _ask(qwen3, CALL, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_reply_given_back_with_its_thinking_reaches_the_template(qwen3):
    reply, _ = _ask(qwen3, THOUGHT)
    history = [*MESSAGES, reply.choices[0].message, {"role": "user", "content": "And 3 + 3?"}]  # as it came
    _, prompt = _ask(qwen3, "x", messages=history)
    assert "<|im_start|>assistant\n<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.<|im_end|>\n" in prompt
    history[1] = {"role": "assistant", "content": "It is 4.", "reasoning_content": None}
    assert "<think>" not in _ask(qwen3, "x", messages=history)[1]


# --- a model without a thinking template -------------------------------------------------------

def test_a_model_without_a_thinking_template_is_unchanged(plain):
    reply, _ = _ask(plain, THOUGHT)
    assert reply.choices[0].message.content == THOUGHT and _reasoning(reply.choices[0].message) is None
    deltas, _ = _stream(plain, THOUGHT)
    assert all(k == "content" for k, _ in deltas) and "".join(t for _, t in deltas) == THOUGHT
    with pytest.raises(openai.BadRequestError) as e:
        _ask(plain, "x", reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort" and "no reasoning control" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a variable the template never reads
        _ask(plain, "x", chat_template_kwargs={"enable_thinking": False})
    assert e.value.body["param"] == "chat_template_kwargs.enable_thinking" and "does not use" in e.value.message


# --- bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, words", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking",
     "true or false"),
    ({"chat_template_kwargs": {"enable_thinking": 0}}, "chat_template_kwargs.enable_thinking", "true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by the server"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the server"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "set by the server"),
    ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs.documents", "set by the server"),
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs.chat_template",
     "set by the server"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "set by the server"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs.eos_token", "set by the server"),
    ({"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs.enable_thinkng", "does not use"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": ["2 + 2"]}]},
     "messages[1].reasoning_content", "must be a string"),
    ({"messages": [{"role": "user", "content": "4", "reasoning_content": "2 + 2"}]}, "messages[0]",
     "does not take"),
    ({"reasoning_effort": "max"}, "reasoning_effort", "must be one of"),
    ({"reasoning_effort": "HIGH"}, "reasoning_effort", "must be one of"),
    ({"reasoning_effort": 1}, "reasoning_effort", "must be one of"),
    ({"reasoning_effort": True}, "reasoning_effort", "must be one of"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort",
     "send one of them"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, "reasoning_effort",
     "send one of them"),
])
def test_bad_values_get_a_400_naming_the_field(qwen3, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(qwen3, "x", **fields)
    assert e.value.body["param"] == param and words in e.value.message, e.value.message


def test_the_fields_belong_to_chat(qwen3):
    for field, value in (("reasoning_effort", "low"), ("chat_template_kwargs", {"enable_thinking": False})):
        with pytest.raises(openai.BadRequestError) as e:
            qwen3.client.completions.create(model="default", prompt="x", max_tokens=4, extra_body={field: value})
        assert e.value.body["param"] == field


# --- a real model: greedy output unchanged, only split -----------------------------------------

# a word-level vocabulary of 64 (the tiny model's) with the chat tags as words
WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "user", "assistant",
         "system"] + [f"w{i}" for i in range(54)]
OPENED_WORDS = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|> assistant <think> "
                "{% if enable_thinking is defined and enable_thinking is false %}</think> {% endif %}{% endif %}")
WORD_MESSAGES = [{"role": "user", "content": "w3 w4 w5 w3 w4"}]
TOKENS = 12


def _save_words(path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = OPENED_WORDS
    fast.save_pretrained(path)


def _prompt_ids(decoder, **variables) -> list[int]:
    text = chat_messages_prompt(decoder.tokenizer, WORD_MESSAGES, variables=variables)
    return decoder.tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny random model whose vocabulary names "</think>" a token its greedy answer has in the
    middle (and that its prompt does not have), so that it closes its thinking there; with the
    plain greedy decoding of it."""
    path = tiny_model_dir(tmp_path_factory.mktemp("thinker") / "target", seed=0)
    words = list(WORDS)
    _save_words(path, words)
    first = SpeculativeDecoder(str(path), method="ar", dtype="float32", pacing=False)
    prompt = _prompt_ids(first)
    out = first.generate(prompt, TOKENS).token_ids
    at = next(j for j in range(1, len(out) - 2) if out[j] >= len(WORDS) - 54 and out[j] not in prompt)
    words[out[at]], words[WORDS.index("</think>")] = "</think>", words[out[at]]
    _save_words(path, words)
    reference = SpeculativeDecoder(str(path), method="ar", dtype="float32", pacing=False)
    assert _prompt_ids(reference) == prompt  # the same prompt: the same greedy answer
    server = RunningServer(SpeculativeDecoder(str(path), method="lookup", dtype="float32", pacing=False))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, reference
    server.stop()


def test_a_real_models_greedy_answer_is_unchanged_and_split_where_it_closes_its_thinking(thinker):
    client, reference = thinker
    want = reference.generate(_prompt_ids(reference), TOKENS)
    assert " </think> " in want.text
    reply = client.chat.completions.create(model="default", messages=WORD_MESSAGES, max_tokens=TOKENS,
                                           temperature=0)
    message = reply.choices[0].message
    reasoning, content = _reasoning(message), message.content
    assert reasoning and content and f"{reasoning} </think> {content}" == want.text
    assert reply.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model="default", messages=WORD_MESSAGES, max_tokens=TOKENS,
                                                 temperature=0, stream=True, logprobs=True))
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == len(want.token_ids)  # every token has its chunk, the thinking's and the answer's
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    # thinking switched off: the template closes it, and the greedy answer is all content
    off = client.chat.completions.create(model="default", messages=WORD_MESSAGES, max_tokens=TOKENS,
                                         temperature=0, reasoning_effort="none")
    assert off.choices[0].message.content == reference.generate(_prompt_ids(reference, enable_thinking=False),
                                                                TOKENS).text
    assert _reasoning(off.choices[0].message) is None
