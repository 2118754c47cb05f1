"""OpenVINO GenAI generation server for the bench; runs INSIDE the OpenVINO virtual environment.

It imports nothing from speculant or the project's dependencies (openvino's own transformers
differs from the project's): only the standard library, numpy, openvino and openvino_genai.
``speculant.bench.openvino`` starts it with the venv's interpreter in isolated mode (``-I``, so
this directory, which holds a module named ``openvino``, is not on ``sys.path``).

    python -I openvino_worker.py --target IR [--draft IR] --config plain|lookup|draft --threads N
                                 [--exact] [--eos ID ...] [--num-assistant-tokens 3] [--max-ngram-size 3]

Protocol, one JSON object per line. On start-up the worker writes
``{"ready": true, "versions": ..., "properties": ..., "load_s": ...}`` (or ``{"error": ...}`` and
exits). Then for each request ``{"ids": [...], "max_new_tokens": N}`` on stdin it generates
greedily from exactly those token ids and writes ``{"ids": new token ids (EOS included when
generation stopped at it), "wall_s", "prefill_s", "decode_s", "finish", "stats"}``; a failed
request gets ``{"error": "..."}`` and the worker keeps running. It exits at end of input.

Timing: ``wall_s`` is measured around ``LLMPipeline.generate`` alone; ``prefill_s`` is the
pipeline's own time to first token (``perf_metrics.get_ttft()``), ``decode_s`` its generate
duration minus that.

``--exact`` forces OpenVINO's CPU plugin to full precision: INFERENCE_PRECISION_HINT=f32,
KV_CACHE_PRECISION=f32, DYNAMIC_QUANTIZATION_GROUP_SIZE=0 (its defaults on CPUs with bf16 support
are bf16 compute, a u8 KV cache and int8 dynamic quantization of activations, group 32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

# never import this directory's openvino.py (speculant's client) as the openvino package
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
REPORTED = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "FULL_DEVICE_NAME")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="OpenVINO IR directory of the target model")
    p.add_argument("--draft", help="OpenVINO IR directory of the draft model (config draft)")
    p.add_argument("--config", choices=("plain", "lookup", "draft"), default="plain")
    p.add_argument("--threads", type=int, default=0, help="INFERENCE_NUM_THREADS (0: OpenVINO's choice)")
    p.add_argument("--exact", action="store_true", help="f32 compute, f32 KV cache, no dynamic quantization")
    p.add_argument("--eos", type=int, nargs="*", default=None,
                   help="stop token ids (default: the IR's generation_config.json eos_token_id)")
    p.add_argument("--num-assistant-tokens", type=int, default=3)
    p.add_argument("--max-ngram-size", type=int, default=3)
    return p.parse_args(argv)


def _str(v):
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    return v.to_string() if hasattr(v, "to_string") else str(v)  # openvino.Type: "bf16", "u8"


def main(argv=None) -> int:
    # the protocol owns the real stdout; anything else written to fd 1 (native libraries' logs,
    # stray prints) goes to stderr instead
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        args = _parse(argv)
        import numpy as np
        import openvino as ov
        import openvino_genai as genai

        props = {}
        if args.threads:
            props["INFERENCE_NUM_THREADS"] = args.threads
        if args.exact:
            props.update(EXACT)
        t = time.perf_counter()
        kw = dict(props)
        if args.config == "lookup":
            kw["prompt_lookup"] = True
        elif args.config == "draft":
            if not args.draft:
                raise ValueError("--config draft needs --draft IR")
            kw["draft_model"] = genai.draft_model(args.draft, "CPU", **props)
        pipe = genai.LLMPipeline(args.target, "CPU", **kw)
        load_s = time.perf_counter() - t

        base = pipe.get_generation_config()
        eos = list(args.eos) if args.eos else ([base.eos_token_id] if base.eos_token_id >= 0 else [])
        if not eos:
            raise ValueError("no EOS token id: pass --eos")

        def config(max_new_tokens: int):
            c = genai.GenerationConfig()
            c.max_new_tokens = max_new_tokens
            c.do_sample = False
            c.num_beams = 1
            c.repetition_penalty = 1.0
            c.eos_token_id = eos[0]
            c.stop_token_ids = set(eos)
            c.ignore_eos = False
            c.apply_chat_template = False  # token ids in: no template, no tokenizer
            if args.config == "lookup":
                c.num_assistant_tokens = args.num_assistant_tokens
                c.max_ngram_size = args.max_ngram_size
            elif args.config == "draft":
                c.num_assistant_tokens = args.num_assistant_tokens
            c.validate()
            return c

        core = ov.Core()
        defaults = {}  # the CPU plugin's defaults on this machine (what applies unless overridden)
        for k in REPORTED:
            try:
                defaults[k] = _str(core.get_property("CPU", k))
            except Exception:  # noqa: BLE001 - a property this version does not know
                defaults[k] = None
        reply({"ready": True, "config": args.config, "exact": args.exact, "eos": eos, "load_s": load_s,
               "threads": args.threads, "cpu_defaults": defaults,
               "properties": {**defaults, **{k: _str(v) for k, v in props.items()}},  # in effect
               "versions": {"openvino": ov.get_version(), "openvino_genai": genai.get_version()}})
    except Exception as e:  # noqa: BLE001 - report start-up failures on the protocol, then exit
        traceback.print_exc()
        reply({"error": f"start-up failed: {type(e).__name__}: {e}"})
        return 1

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            ids = [int(i) for i in req["ids"]]
            n = int(req["max_new_tokens"])
            if not ids or n < 1:
                raise ValueError("need non-empty ids and max_new_tokens >= 1")
            tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
            gc = config(n)
            t = time.perf_counter()
            res = pipe.generate(tensor, gc)
            wall = time.perf_counter() - t
            out = [int(i) for i in res.tokens[0]]
            pm = res.perf_metrics
            ttft = pm.get_ttft().mean / 1000.0
            gen = pm.get_generate_duration().mean / 1000.0
            stats = {"num_generated_tokens": int(pm.get_num_generated_tokens()),
                     "num_input_tokens": int(pm.get_num_input_tokens())}
            ext = getattr(res, "extended_perf_metrics", None)
            if ext is not None and args.config != "plain":  # SDPerModelsPerfMetrics
                for name in ("num_accepted_tokens", "num_rejected_tokens", "num_draft_tokens"):
                    try:
                        stats[name] = int(getattr(ext, "get_" + name)())
                    except Exception:  # noqa: BLE001 - absent in another version
                        pass
                try:  # one entry per target model inference (prefill, then each verification)
                    stats["target_calls"] = len(ext.main_model_metrics.raw_metrics.m_durations)
                except Exception:  # noqa: BLE001 - absent in another version
                    pass
            reply({"ids": out, "wall_s": wall, "prefill_s": ttft, "decode_s": max(gen - ttft, 0.0),
                   "finish": res.finish_reasons[0].name.lower() if getattr(res, "finish_reasons", None) else None,
                   "stats": stats})
        except Exception as e:  # noqa: BLE001 - one bad request must not end the worker
            traceback.print_exc()
            reply({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
