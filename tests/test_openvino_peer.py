"""The OpenVINO GenAI bench peer (a benchmark extra: skipped unless `make install-openvino` ran)."""

import pytest
import torch

from speculant.bench.openvino import OpenVINOError, OpenVINOPeer, openvino_unavailable
from speculant.errors import ConfigError

_why = openvino_unavailable(draft=False)
needs_openvino = pytest.mark.skipif(_why is not None, reason=f"OpenVINO peer not installed: {_why}")

EOS = 151645  # Qwen2.5 <|im_end|>


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    import speculant.store.models as m

    tok = AutoTokenizer.from_pretrained(str(m.resolve("qwen2.5-coder-1.5b-instruct")))
    texts = ["What is 2+2? Answer with just the number.",
             "Write a Python function that returns the square of a number."]
    return [tok(m.chat_prompt(tok, t), add_special_tokens=False, return_tensors="pt").input_ids[0] for t in texts]


@pytest.mark.real
@needs_openvino
def test_plain_is_deterministic_and_stops_at_eos_or_max(prompts):
    n = 12
    with OpenVINOPeer("plain", eos_token_ids={EOS}) as peer:
        assert peer.info["ready"] and peer.info["eos"] == [EOS]
        first = [peer.run(ids, n) for ids in prompts]
        again = [peer.run(ids, n)[0] for ids in prompts]
        assert [out for out, _, _ in first] == again
        for out, wall, timing in first:
            assert 1 <= len(out) <= n and all(isinstance(t, int) for t in out)
            # ends at EOS (kept, as speculant does) or at the token limit; no EOS before the end
            assert out[-1] == EOS or len(out) == n
            assert EOS not in out[:-1]
            assert wall > 0 and timing["prefill_s"] > 0 and timing["decode_s"] >= 0
        assert first[0][0][-1] == EOS  # "4<|im_end|>": a short answer ends at EOS
        assert len(first[1][0]) == n  # the function does not fit in 12 tokens
        with pytest.raises(OpenVINOError, match="non-empty"):
            peer.run(torch.tensor([], dtype=torch.long), 4)
        assert peer.run(prompts[0], n)[0] == first[0][0]  # the worker survives a bad request


def test_unknown_config_is_rejected():
    with pytest.raises(ConfigError, match="plain, lookup, draft"):
        OpenVINOPeer("beam")


@pytest.mark.real
@needs_openvino
def test_worker_start_up_failure_is_reported(tmp_path):
    with pytest.raises(OpenVINOError, match="start-up failed"):
        OpenVINOPeer("plain", target=tmp_path)  # no IR there
