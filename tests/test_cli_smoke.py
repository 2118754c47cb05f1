"""A smoke grid over every command of the CLI with unusual and bad options, on tiny models: each
run succeeds, or exits non-zero with one error line on stderr (ours: ``speculant: error: ...``;
argparse's: its usage, then ``speculant COMMAND: error: ...``) that names the problem, and never
with a Python traceback. Commands that would start a server or load a real model are given only
options that fail before that."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from speculant.cli.commands import main

from tiny import tiny_llama, tiny_model_dir

OK = None  # the run succeeds (exit status 0)
LONG = " ".join(["w5"] * 600)  # more tokens than the tiny models' context of 512

# (id, argv with placeholders, OK or a text of the one error line). Placeholders: @T target, @D draft
# (same vocabulary), @O a model of another vocabulary, @M Medusa heads, @HY sequential heads, @E an
# EAGLE drafter, @EV one with a draft vocabulary, @C a corpus JSONL, @Q questions, @TMP a fresh
# directory, @NONE a path that does not exist, @FILE a file that is not what is asked for.
G = ["generate", "--target", "@T", "--dtype", "float32"]
CASES = [
    ("warm-drafts-zero-limit", ["warm-drafts", "--target", "@T", "--limit", "0"], "--limit must be >= 1"),
    ("gen-ok", [*G, "--method", "ar", "--max-new-tokens", "3", "w1 w2"], OK),
    ("chat-zero-tokens", ["chat", "--target", "@T", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("chat-bad-temperature", ["chat", "--target", "@T", "--temperature", "-1"], "temperature must be >= 0"),
    ("chat-cache-ram-negative", ["chat", "--target", "@T", "--cache-ram", "-1"], "--cache-ram is the prefix cache's"),
    ("gen-zero-tokens", [*G, "--max-new-tokens", "0", "w1"], "--max-new-tokens must be >= 1, got 0"),
    ("gen-negative-tokens", [*G, "--max-new-tokens", "-5", "w1"], "--max-new-tokens must be >= 1, got -5"),
    ("gen-huge-tokens", [*G, "--method", "ar", "--max-new-tokens", "100000", "w1"], OK),  # stops at the context
    ("gen-negative-temperature", [*G, "--temperature", "-1", "w1"], "temperature must be >= 0"),
    ("gen-infinite-temperature", [*G, "--temperature", "inf", "w1"], "temperature must be 0 (greedy) or from"),
    ("gen-tiny-temperature", [*G, "--temperature", "1e-40", "w1"], "logits / temperature must stay finite"),
    ("gen-huge-top-k", [*G, "--method", "lookup", "--temperature", "0.7", "--top-k", "1000000", "--seed", "1",
                        "--max-new-tokens", "3", "w1 w2"], OK),
    ("gen-negative-top-k", [*G, "--top-k", "-3", "w1"], "top_k must be >= 0"),
    ("gen-nan-top-p", [*G, "--temperature", "0.7", "--top-p", "nan", "w1"], "top_p must be in (0, 1]"),
    ("gen-seed-not-integer", [*G, "--seed", "1.5", "w1"], "argument --seed: invalid int value: '1.5'"),
    ("gen-seed-too-large", [*G, "--temperature", "0.7", "--seed", "9" * 30, "w1"],
     "seed must be an integer from -2**63 to 2**64 - 1"),
    ("gen-negative-seed", [*G, "--method", "ar", "--temperature", "0.7", "--seed", "-1", "--max-new-tokens", "2",
                           "w1"], OK),
    ("gen-unknown-method", [*G, "--method", "turbo", "w1"], "argument --method: invalid choice: 'turbo'"),
    ("gen-penalties-ok", [*G, "--method", "lookup", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                          "--repetition-penalty", "1.2", "--logit-bias", "3=-100", "--min-p", "0.1", "--temperature",
                          "0.7", "--seed", "1", "--max-new-tokens", "3", "--json", "--logprobs", "2", "w1 w2"], OK),
    ("gen-presence-out-of-range", [*G, "--presence-penalty", "5", "w1"], "presence_penalty must be between -2 and 2"),
    ("gen-repetition-zero", [*G, "--repetition-penalty", "0", "w1"], "repetition_penalty must be > 0"),
    ("gen-logit-bias-malformed", [*G, "--logit-bias", "x", "w1"], "--logit-bias 'x': use TOKEN=BIAS"),
    ("gen-logit-bias-huge", [*G, "--logit-bias", "3=500", "w1"], "logit_bias values must be between -100 and 100"),
    ("gen-logit-bias-outside-vocab", [*G, "--method", "ar", "--logit-bias", "99999999=1", "w1"],
     "outside the vocabulary"),
    ("gen-min-p-one", [*G, "--min-p", "1", "w1"], "min_p must be in [0, 1)"),
    ("gen-logprobs-too-many", [*G, "--logprobs", "30", "w1"], "--logprobs must be from 0 to 20"),
    ("gen-malformed-tree", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "4x2x", "w1"], "malformed tree spec"),
    ("gen-tree-bad-json", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "[[0],[0,1", "w1"], "is not valid JSON"),
    ("gen-tree-gap", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "[[1]]", "w1"], "skips rank 0"),
    ("gen-tree-empty", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "[]", "w1"], "has no nodes"),
    ("gen-tree-huge", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "100x100x100", "w1"],
     "has more than 1024 nodes"),
    ("gen-tree-file-not-a-tree", [*G, "--method", "mcsd", "--draft", "@D", "--tree-file", "@C", "w1"],
     "malformed tree spec"),
    ("gen-tree-file-missing", [*G, "--method", "mcsd", "--draft", "@D", "--tree-file", "@NONE", "w1"],
     "cannot read --tree-file"),
    ("gen-dynamic-tree-huge", [*G, "--method", "medusa", "--heads", "@M", "--tree", "dynamic:5000", "w1"],
     "a dynamic tree of 5000 nodes: at most 1024"),
    ("gen-dynamic-tree-bad", [*G, "--method", "medusa", "--heads", "@M", "--tree", "dynamic:x", "w1"],
     "malformed dynamic tree"),
    ("gen-dynamic-tree-for-mcsd", [*G, "--method", "mcsd", "--draft", "@D", "--tree", "dynamic", "w1"],
     "is grown from heads"),
    ("gen-heads-of-another-kind", [*G, "--method", "hydra", "--heads", "@M", "w1"], "use --method medusa"),
    ("gen-eagle-with-heads", [*G, "--method", "eagle", "--heads", "@M", "w1"], "needs an EAGLE drafter"),
    ("gen-missing-target", ["generate", "--target", "@NONE", "w1"], "no such model"),
    ("gen-target-not-a-model", ["generate", "--target", "@FILE", "w1"], "is not a GGUF file"),
    ("gen-target-empty-dir", ["generate", "--target", "@TMP", "w1"], "not a transformers model directory"),
    ("gen-empty-prompt", [*G, ""], "the prompt is empty"),
    ("gen-blank-prompt", [*G, " \n\t "], "the prompt is empty"),
    ("gen-lone-surrogate", [*G, "\ud800 hi"], "the prompt has a lone surrogate U+D800 at character 0"),
    ("gen-undecodable-byte", [*G, "w1 \udcff"], "(the byte 0xFF, which is not UTF-8)"),
    ("gen-nul", [*G, "w1\x00w2"], "the prompt has a NUL character (U+0000) at character 2"),
    ("gen-nul-on-stdin", [*G, "-"], "the prompt has a NUL character"),
    ("gen-stop-surrogate", [*G, "--stop", "\udcc3", "w1"], "the stop string has a lone surrogate U+DCC3"),
    ("gen-stop-empty", [*G, "--stop", "", "w1"], "a stop string is empty"),
    ("gen-long-prompt", [*G, "--method", "ar", LONG], "context"),
    ("gen-chat-without-template", [*G, "--method", "ar", "--chat", "--max-new-tokens", "2", "w1"], OK),
    ("gen-draft-other-vocabulary", [*G, "--method", "sd", "--draft", "@O", "w1"], "different vocabularies"),
    ("gen-draft-missing", [*G, "--method", "sd", "--draft", "@NONE", "w1"], "no such model"),
    ("gen-gamma-negative", [*G, "--method", "sd", "--draft", "@D", "--gamma", "-2", "w1"], "between 1 and 64"),
    ("gen-lookup-branch-for-ar", [*G, "--method", "ar", "--lookup-branch", "3", "w1"], "lookup_branch=3"),
    ("gen-bad-accept", [*G, "--accept", "typical=abc", "w1"], "cannot read acceptance rule"),
    ("gen-int4-float32", [*G, "--backend", "native", "--target-quant", "int4", "w1"], "need a bfloat16 model"),
    ("gen-quant-on-hf", [*G, "--backend", "hf", "--target-quant", "int8", "w1"], "runs on the native backend"),
    ("gen-native-bf16-odd-shapes", ["generate", "--target", "@T", "--dtype", "bfloat16", "--backend", "native",
                                    "--target-quant", "none", "--method", "ar", "--max-new-tokens", "3", "w1"], OK),
    ("gen-lora-missing", [*G, "--lora", "@NONE", "w1"], "no such directory"),
    ("gen-json", [*G, "--method", "ar", "--json", "--max-new-tokens", "2", "w1"], OK),
    ("gen-cache-ram-off", [*G, "--method", "ar", "--cache-ram", "0", "--max-new-tokens", "2", "w1"], OK),
    ("gen-cache-ram-small", [*G, "--method", "lookup", "--backend", "native", "--cache-ram", "1",
                             "--max-new-tokens", "2", "w1"], OK),
    ("gen-cache-ram-negative", [*G, "--cache-ram", "-1", "w1"], "--cache-ram is the prefix cache's memory in MiB"),
    ("gen-cache-ram-text", [*G, "--cache-ram", "lots", "w1"], "argument --cache-ram: invalid int value: 'lots'"),

    ("serve-port-zero", ["serve", "--target", "@T", "--port", "0"], "--port must be in 1..65535"),
    ("serve-port-text", ["serve", "--port", "http"], "argument --port: invalid int value"),
    ("serve-cache-ram-negative", ["serve", "--target", "@T", "--cache-ram", "-8"],
     "--cache-ram is the prefix cache's memory in MiB, >= 0 (0: no prefix cache), got -8"),
    ("serve-batch-zero", ["serve", "--target", "@T", "--max-batch", "0"], "--max-batch must be >= 1"),
    ("serve-unknown-method", ["serve", "--method", "turbo"], "argument --method: invalid choice"),
    ("serve-missing-target", ["serve", "--target", "@NONE", "--port", "8999"], "no such model"),
    ("serve-draft-other-vocabulary", ["serve", "--target", "@T", "--dtype", "float32", "--method", "sd", "--draft",
                                      "@O", "--port", "8999"], "different vocabularies"),

    ("bench-unknown-method", ["bench", "--methods", "ar,turbo"], "unknown bench method 'turbo'"),
    ("bench-cache-ram-negative", ["bench", "--methods", "ar", "--cache-ram", "-1"], "--cache-ram is the prefix"),
    ("bench-no-ar", ["bench", "--methods", "lookup"], "needs the 'ar' baseline"),
    ("bench-empty-method", ["bench", "--methods", "ar,"], "unknown bench method ''"),
    ("bench-zero-tokens", ["bench", "--methods", "ar", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("bench-negative-temperature", ["bench", "--methods", "ar", "--temperature", "-1"], "--temperature must be >= 0"),
    ("bench-tiny-temperature", ["bench", "--methods", "ar", "--temperature", "1e-40"], "must stay finite"),
    ("bench-seed-text", ["bench", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    ("bench-questions-missing", ["bench", "--methods", "ar", "--questions", "@NONE"], "cannot read --questions"),
    ("bench-questions-not-questions", ["bench", "--methods", "ar", "--questions", "@C"], "line 1 is not a question"),
    ("bench-json-out-missing-dir", ["bench", "--methods", "ar", "--json-out", "@NONE/b.json"],
     "does not exist (create it or pick another path)"),
    ("bench-json-out-a-directory", ["bench", "--methods", "ar", "--json-out", "@TMP"], "is a directory"),
    ("bench-plot-missing-dir", ["bench", "--methods", "ar", "--plot", "@NONE/p.png"], "cannot write the plot"),
    ("bench-unknown-category", ["bench", "--target", "@T", "--draft", "@D", "--dtype", "float32", "--methods", "ar",
                                "--questions", "@Q", "--categories", "poetry"], "no questions in category 'poetry'"),
    ("bench-draft-other-vocabulary", ["bench", "--target", "@T", "--draft", "@O", "--dtype", "float32", "--methods",
                                      "ar,sd", "--questions", "@Q", "--categories", "qa"], "different vocabularies"),
    ("bench-huge-tree", ["bench", "--target", "@T", "--draft", "@D", "--dtype", "float32", "--methods", "ar,mcsd",
                         "--tree", "100x100x100", "--questions", "@Q", "--categories", "qa"], "more than 1024 nodes"),
    ("bench-sampled", ["bench", "--target", "@T", "--draft", "@D", "--dtype", "float32", "--methods", "ar,lookup,sd",
                       "--questions", "@Q", "--categories", "qa", "--max-new-tokens", "3", "--temperature", "0.7",
                       "--json-out", "@TMP/b.json"], OK),

    ("report-missing", ["bench-report", "@NONE"], "cannot read the bench JSON"),
    ("report-not-json", ["bench-report", "@C"], "is not JSON"),
    ("report-a-directory", ["bench-report", "@TMP"], "cannot read the bench JSON"),
    ("report-bad-plot", ["bench-report", "@C", "--plot", "x.nope"], "is not JSON"),

    ("bench-serve-unknown-row", ["bench-serve", "--rows", "turbo"], "unknown bench-serve row turbo"),
    ("bench-serve-no-rows", ["bench-serve", "--rows", ""], "needs at least one row"),
    ("bench-serve-bad-concurrency", ["bench-serve", "--concurrency", "x"], "takes comma-separated integers"),
    ("bench-serve-zero-concurrency", ["bench-serve", "--concurrency", "0"], "levels from 1 to 64"),
    ("bench-serve-unclosed-quote", ["bench-serve", "--serve-args", "'--target"], "cannot split --serve-args"),
    ("bench-serve-json-out-missing-dir", ["bench-serve", "--json-out", "@NONE/s.json"], "does not exist"),
    ("bench-serve-questions-missing", ["bench-serve", "--questions", "@NONE"], "cannot read --questions"),

    ("quant-eval-unknown-mode", ["quant-eval", "--target", "@T", "--modes", "int3"], "--modes takes"),
    ("quant-eval-zero-tokens", ["quant-eval", "--target", "@T", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    ("quant-eval-json-out-missing-dir", ["quant-eval", "--target", "@T", "--json-out", "@NONE/q.json"],
     "does not exist"),
    ("quant-eval-missing-target", ["quant-eval", "--target", "@NONE"], "no such model"),
    ("quant-eval-ok", ["quant-eval", "--target", "@T", "--modes", "none,int8", "--max-new-tokens", "3"], OK),

    ("demo-unknown-method", ["demo", "--methods", "turbo"], "demo methods must be"),
    ("demo-zero-tokens", ["demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
]

def _swap(argv: list[str], old: str, new: str) -> list[str]:
    return [new if a == old else a for a in argv]


H = ["train-heads", "--target", "@T", "--dtype", "float32", "--out", "@TMP/h", "--skip-distill", "--data", "@C",
     "--num-heads", "2", "--seq-len", "16", "--held-out", "0.34", "--steps", "1"]
E = ["train-eagle", "--target", "@T", "--data", "@C", "--out", "@TMP/e", "--held-out", "1", "--seq-len", "16",
     "--batch-size", "2", "--depth", "2", "--steps", "1"]
TRAINING = [
    ("heads-ok", H, OK),
    ("heads-data-missing", _swap(H, "@C", "@NONE"), "no such file"),
    ("heads-data-not-records", _swap(H, "@C", "@Q"), "no training records"),
    ("heads-zero-steps", [*H[:-1], "0"], "steps must be >= 1"),
    ("heads-zero-heads", [*H, "--num-heads", "0"], "num_heads must be an integer >= 1"),
    ("heads-held-out-above-1", [*H, "--held-out", "2"], "held_out_fraction must be in [0, 1)"),
    ("heads-zero-rows-per-batch", [*H, "--rows-per-batch", "0"], "rows_per_batch must be >= 1"),
    ("heads-negative-lr", [*H, "--lr-heads", "-1"], "lr_heads (the learning rate) must be > 0"),
    ("heads-out-a-file", _swap(H, "@TMP/h", "@FILE"), "is a file, not a directory"),
    ("heads-out-under-a-file", _swap(H, "@TMP/h", "@FILE/h"), "is a file, not a directory"),
    ("heads-init-missing", [*H, "--init-from", "@NONE"], "no heads checkpoint"),
    ("heads-zero-distill-batch", ["train-heads", "--target", "@T", "--out", "@TMP/h", "--distill-batch", "0"],
     "--distill-batch must be >= 1"),
    ("heads-negative-stdlib", ["train-heads", "--target", "@T", "--out", "@TMP/h", "--n-stdlib", "-1"],
     "--n-stdlib must be >= 0"),
    ("heads-german-from-missing", ["train-heads", "--target", "@T", "--out", "@TMP/h", "--prompts", "english",
                                   "--german-from", "@NONE"], "--german-from"),
    ("heads-missing-target", ["train-heads", "--target", "@NONE", "--out", "@TMP/h"], "no such model"),

    ("tree-ok", ["build-tree", "--target", "@T", "--dtype", "float32", "--heads", "@M", "--calib", "@C",
                 "--budget", "4", "--out", "@TMP/t.json"], OK),
    ("tree-heads-missing", ["build-tree", "--target", "@T", "--heads", "@NONE", "--calib", "@C", "--out",
                            "@TMP/t.json"], "no heads checkpoint"),
    ("tree-calib-missing", ["build-tree", "--target", "@T", "--heads", "@M", "--calib", "@NONE", "--out",
                            "@TMP/t.json"], "no calibration records"),
    ("tree-negative-budget", ["build-tree", "--target", "@T", "--dtype", "float32", "--heads", "@M", "--calib", "@C",
                              "--budget", "-3", "--out", "@TMP/t.json"], "budget must be an integer >= 0"),
    ("tree-negative-limit", ["build-tree", "--target", "@T", "--heads", "@M", "--calib", "@C", "--limit", "-1",
                             "--out", "@TMP/t.json"], "--limit must be >= 1"),
    ("tree-heads-other-vocabulary", ["build-tree", "--target", "@O", "--dtype", "float32", "--heads", "@M",
                                     "--calib", "@C", "--out", "@TMP/t.json"], "trained for another model"),

    ("export-heads-ok", ["export-heads", "--target", "@T", "--dtype", "float32", "--heads", "@M", "--format",
                         "vllm", "--out", "@TMP/x"], OK),
    ("export-heads-none-shipped", ["export-heads", "--target", "@T", "--dtype", "float32", "--format", "medusa",
                                   "--out", "@TMP/x"], "no Medusa heads ship"),
    ("export-heads-sequential", ["export-heads", "--target", "@T", "--dtype", "float32", "--heads", "@HY",
                                 "--format", "medusa", "--out", "@TMP/x"], "only Medusa heads can be exported"),
    ("export-heads-bad-format", ["export-heads", "--heads", "@M", "--format", "onnx", "--out", "@TMP/x"],
     "argument --format: invalid choice"),
    ("export-heads-out-a-file", ["export-heads", "--target", "@T", "--heads", "@M", "--format", "vllm", "--out",
                                 "@FILE"], "is a file, not a directory"),

    ("corpus-zero-tokens", ["make-corpus", "--target", "@T", "--out", "@TMP/c", "--tokens", "0"], "--tokens must be"),
    ("corpus-unknown-method", ["make-corpus", "--target", "@T", "--out", "@TMP/c", "--method", "turbo"],
     "unknown method 'turbo'"),
    ("corpus-out-a-file", ["make-corpus", "--target", "@T", "--out", "@FILE"], "is a file, not a directory"),
    ("corpus-ok", ["make-corpus", "--target", "@T", "--out", "@TMP/c", "--tokens", "4", "--max-new-tokens", "2",
                   "--batch", "2", "--method", "ar"], OK),

    ("conversations-zero-tokens", ["make-conversations", "--target", "@T", "--out", "@TMP/c", "--tokens", "0"],
     "--tokens must be >= 1"),
    ("conversations-unknown-source", ["make-conversations", "--target", "@T", "--out", "@TMP/c", "--sources",
                                      "irc"], "unknown conversation source"),
    ("conversations-out-a-file", ["make-conversations", "--target", "@T", "--out", "@FILE"],
     "is a file, not a directory"),

    ("eagle-ok", [*E, "--draft-vocab", "16"], OK),
    ("eagle-data-missing", ["train-eagle", "--target", "@T", "--data", "@NONE", "--out", "@TMP/e"], "no file"),
    ("eagle-data-not-records", _swap(E, "@C", "@Q"), "no records in"),
    ("eagle-data-zero-records", _swap(E, "@C", "@C@0"), "FILE@N takes N >= 1 records"),
    ("eagle-zero-steps", [*E[:-1], "0"], "steps must be an integer >= 1"),
    ("eagle-negative-draft-vocab", [*E, "--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
    ("eagle-init-not-a-drafter", [*E, "--init", "@M"], "no EAGLE drafter there"),
    ("eagle-out-a-file", _swap(E, "@TMP/e", "@FILE"), "is a file, not a directory"),
    ("eagle-other-vocabulary", [*_swap(E, "@T", "@O"), "--init", "@E"], "trained for another model"),

    # train-drafter: only options refused before it installs data packages or loads the model
    ("drafter-zero-tokens", ["train-drafter", "--target", "@T", "--out", "@TMP/d", "--tokens", "0"],
     "--tokens must be"),
    ("drafter-unknown-source", ["train-drafter", "--target", "@T", "--out", "@TMP/d", "--sources", "irc"],
     "unknown conversation source"),
    ("drafter-lr-text", ["train-drafter", "--out", "@TMP/d", "--lr", "fast"], "argument --lr: invalid float value"),
    ("accuracy-no-data", ["drafter-accuracy", "--target", "@T", "--data", "@NONE", "--eagle", "@E"],
     "no corpus records there"),
    ("accuracy-depth-zero", ["drafter-accuracy", "--target", "@T", "--data", "@NONE", "--depth", "0"],
     "--depth must be >= 1"),
    ("accuracy-all-with-features", ["drafter-accuracy", "--target", "@T", "--data", "@NONE", "--all-records",
                                    "--features", "@TMP/f"], "measures a text no drafter trained on"),

    ("export-eagle-ok", ["export-eagle", "--drafter", "@E", "--format", "vllm", "--out", "@TMP/x"], OK),
    ("export-eagle-missing", ["export-eagle", "--drafter", "@NONE", "--format", "vllm", "--out", "@TMP/x"],
     "no EAGLE drafter at"),
    ("export-eagle-eagle3", ["export-eagle", "--drafter", "@E", "--format", "eagle3", "--out", "@TMP/x"],
     "EAGLE-3 export is not possible"),
    ("export-eagle-out-a-file", ["export-eagle", "--drafter", "@E", "--format", "sglang", "--out", "@FILE"],
     "is a file, not a directory"),

    ("cut-vocab-ok", ["cut-vocab", "--drafter", "@EV", "--data", "@C", "--size", "16", "--held-out", "1", "--out",
                      "@TMP/x"], OK),
    ("cut-vocab-whole-vocabulary", ["cut-vocab", "--drafter", "@E", "--data", "@C", "--size", "10", "--out",
                                    "@TMP/x"], "no draft vocabulary to cut"),
    ("cut-vocab-missing", ["cut-vocab", "--drafter", "@NONE", "--data", "@C", "--size", "10", "--out", "@TMP/x"],
     "no drafter at"),
    ("cut-vocab-data-missing", ["cut-vocab", "--drafter", "@EV", "--data", "@NONE", "--size", "10", "--out",
                                "@TMP/x"], "no file"),
    ("cut-vocab-out-a-file", ["cut-vocab", "--drafter", "@EV", "--data", "@C", "--size", "16", "--out", "@FILE"],
     "is a file, not a directory"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from speculant import SpeculativeDecoder
    from speculant.eagle.checkpoint import save_eagle
    from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads, save_heads
    from test_eagle import eagle_for

    root = tmp_path_factory.mktemp("cli-smoke")
    target = tiny_model_dir(root / "target", seed=0)
    tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3)
    tiny_model_dir(root / "other", seed=2, vocab=80)
    lm = SpeculativeDecoder(str(target), method="ar", dtype="float32").target.model
    H = lm.config.hidden_size
    save_heads(MedusaHeads(HeadsConfig(3, 1, H, 64), lm.get_output_embeddings()), root / "medusa")
    save_heads(SequentialHeads(HeadsConfig(3, 1, H, 64, kind="sequential"), lm.get_output_embeddings(),
                               lm.get_input_embeddings()), root / "hydra")
    save_eagle(eagle_for(lm), root / "eagle")
    narrow = eagle_for(lm, draft_vocab=32)
    narrow.set_draft_vocab(torch.arange(4, 36))
    save_eagle(narrow, root / "eagle-vocab")
    g = torch.Generator().manual_seed(0)
    records = [{"ids": torch.randint(3, 64, (40,), generator=g).tolist(), "prompt_len": 10} for _ in range(6)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "questions.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
        for i, t in enumerate(["w1 w2", "w3"], 1)))
    (root / "file.txt").write_text("not a model, not a directory\n")
    return {"@T": root / "target", "@D": root / "draft", "@O": root / "other", "@M": root / "medusa",
            "@HY": root / "hydra", "@EV": root / "eagle-vocab", "@E": root / "eagle", "@C": root / "corpus.jsonl",
            "@Q": root / "questions.jsonl", "@FILE": root / "file.txt", "@NONE": root / "none"}


def _argv(argv: list[str], paths: dict, tmp) -> list[str]:
    names = sorted({**paths, "@TMP": tmp}.items(), key=lambda kv: -len(kv[0]))  # @EV before @E
    out = []
    for a in argv:
        for key, value in names:
            a = a.replace(key, str(value))
        out.append(a)
    return out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``speculant ARGV`` in this process: (exit status, stderr). Any exception but argparse's exit
    escapes: that is the crash this grid looks for."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage, then one error line
        code = e.code
    return code, capsys.readouterr().err


def _check(case: str, argv: list[str], expect, paths, tmp_path, capsys, monkeypatch) -> None:
    if case == "gen-nul-on-stdin":
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 \x00 w2")))
    code, err = _run(_argv(argv, paths, tmp_path), capsys)
    assert "Traceback" not in err, err
    if expect is OK:
        assert code == 0, err
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None) and lines, err
    last = lines[-1]
    ours = last.startswith("speculant: error: ")
    argparse_error = last.startswith(f"speculant {argv[0]}: error: ") and lines[0].startswith("usage:")
    assert ours or argparse_error, err
    if ours:  # one line: nothing of it before the last line
        assert not any(line.startswith("speculant: error:") for line in lines[:-1]), err
    assert expect in last, err


@pytest.mark.parametrize("case, argv, expect", CASES, ids=[c[0] for c in CASES])
def test_cli_command(case, argv, expect, paths, tmp_path, capsys, monkeypatch):
    _check(case, argv, expect, paths, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("case, argv, expect", TRAINING, ids=[c[0] for c in TRAINING])
def test_cli_training_command(case, argv, expect, paths, tmp_path, capsys, monkeypatch):
    _check(case, argv, expect, paths, tmp_path, capsys, monkeypatch)


def test_every_command_is_in_the_grid():
    from speculant.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    covered = {argv[0] for _, argv, _ in CASES + TRAINING}
    assert set(sub.choices) <= covered, set(sub.choices) - covered


def test_bench_serve_stops_a_server_that_fails_or_is_interrupted_while_it_starts(paths, monkeypatch):
    """A server stopped by Ctrl-C (or any error) while it starts is closed, not left running; one
    that exits on its own (a bad --serve-args option) is a one-line error quoting its last line."""
    from speculant.bench import serve_bench
    from speculant.errors import SpeculantError

    closed = []

    class Interrupted:
        def start(self):
            raise KeyboardInterrupt

        def close(self):
            closed.append(True)

    monkeypatch.setattr(serve_bench, "_server", lambda row, cfg: Interrupted())
    cfg = serve_bench.ServeBenchConfig(rows=("speculant",), questions=str(paths["@Q"]), categories=("qa",))
    with pytest.raises(KeyboardInterrupt):
        serve_bench.run_serve_bench(cfg, log=lambda *a: None)
    assert closed == [True]
    monkeypatch.undo()

    class Exited:  # a `speculant serve` that printed its error and exited with status 2
        returncode = 2

        def __init__(self, cmd, stdout, **kw):
            stdout.write(b"speculant: note: something\nspeculant: error: no such model: /x\n")

        def poll(self):
            return 2

    monkeypatch.setattr(serve_bench.subprocess, "Popen", Exited)
    server = serve_bench.SpeculantServer(None, ("--target", "/x"), startup_timeout=5)
    with pytest.raises(SpeculantError, match=r"^`speculant serve .*--target /x` exited with status 2: "
                                             r"speculant: error: no such model: /x$"):
        server.start()
    assert server._log is None  # closed
