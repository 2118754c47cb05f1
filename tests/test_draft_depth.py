"""Per-request speculation control: ``max_draft_depth`` (library) and the server's extension
``speculative`` cut each step's draft to k tokens deep (0: plain decoding); the output is plain
decoding's for every k, only the number of target passes changes."""

from __future__ import annotations

import openai
import pytest
import torch

from speculant import ConfigError, SpeculativeDecoder
from speculant.trees.draft import Draft, within_depth
from speculant.serve.errors import APIError
from speculant.serve.schema import parse_request
from speculant.trees.buffers import build_tree

from serve_helpers import CHAT_TEMPLATE, RunningServer
from tiny import tiny_llama, tiny_model_dir

PROMPT = "w3 w4 w5 w3 w4 w5 w3"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.1)
    return str(target), str(draft)


def test_within_depth_keeps_the_first_nodes_and_their_indices():
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tokens = torch.arange(tree.size)
    q = torch.rand(tree.size, 5)
    cut = within_depth(Draft(tree, tokens, q), 1)
    assert cut.tree.size == 3 and cut.tree.depth == 1 and cut.tree.paths == tree.paths[:3]
    assert torch.equal(cut.tokens, tokens[:3]) and torch.equal(cut.q, q[:3])
    two = within_depth(Draft(tree, tokens, None), 2)
    assert two.tree.paths == tree.paths[:6] and two.q is None
    same = Draft(tree, tokens, q)
    assert within_depth(same, 3) is same
    assert within_depth(same, 0).tree.size == 1


@pytest.mark.parametrize("method", ["sd", "mcsd"])
def test_every_depth_gives_plain_decoding(dirs, method):
    target, draft = dirs
    plain = SpeculativeDecoder(target, method="ar", dtype="float32").generate(PROMPT, 24)
    dec = SpeculativeDecoder(target, draft, method=method, dtype="float32", pacing=False)
    free = dec.generate(PROMPT, 24)
    assert free.token_ids == plain.token_ids and max(free.stats.accepted_per_call) >= 2
    for k in (0, 1, 2):
        out = dec.generate(PROMPT, 24, max_draft_depth=k)
        assert out.token_ids == plain.token_ids, k
        assert max(out.stats.accepted_per_call) <= k
        if k == 0:
            assert sum(out.stats.drafted_per_call) == 0 and out.stats.target_calls >= len(out.token_ids)
    with pytest.raises(ConfigError, match="max_draft_depth"):
        dec.start(PROMPT, 4, max_draft_depth=-1)


def test_the_server_extension(dirs):
    base = {"model": "default", "prompt": "x"}
    assert parse_request({**base, "speculative": False}, "completion").max_draft_depth == 0
    assert parse_request({**base, "speculative": True}, "completion").max_draft_depth is None
    assert parse_request({**base, "speculative": {"max_depth": 2}}, "completion").max_draft_depth == 2
    for value, param in [("off", "speculative"), ({"depth": 2}, "speculative"),
                         ({"max_depth": -1}, "speculative.max_depth"), ({"max_depth": 65}, "speculative.max_depth")]:
        with pytest.raises(APIError) as e:
            parse_request({**base, "speculative": value}, "completion")
        assert e.value.status == 400 and e.value.param == param
    target, draft = dirs
    dec = SpeculativeDecoder(target, draft, method="sd", dtype="float32", pacing=False)
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    server = RunningServer(dec)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        free = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0)
        off = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"speculative": False})
        one = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"speculative": {"max_depth": 1}})
        assert free.choices[0].text == off.choices[0].text == one.choices[0].text
        spec = {name: r.usage.model_extra["speculative"] for name, r in (("free", free), ("off", off), ("one", one))}
        assert spec["off"]["tokens_per_call"] == 1.0 and spec["off"]["acceptance_rate"] == 0.0
        assert 1.0 <= spec["one"]["tokens_per_call"] <= 2.0 < spec["free"]["tokens_per_call"]
    finally:
        server.stop()
