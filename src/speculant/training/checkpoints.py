"""The checkpoints head training (``train.train_heads``) writes and resumes from.

Layout: ``checkpoints/step-XXXXXXXX/`` with ``heads/`` (the heads, Medusa layout), ``lora/``
(Medusa-2's adapters) and ``state.pt`` (optimizer, scheduler, step, the settings' fingerprint,
the held-out metrics so far and the training loss of every step so far).

Writing (the main process only): everything goes into ``.tmp-step-XXXXXXXX/``, ``state.pt`` last,
each file is flushed to disk, and the directory is then renamed into place, so a ``step-*``
directory is whole. A run killed while writing leaves only the temporary directory, which resume
never reads (and removes, saying so).

Resuming: the newest ``step-*`` directory whose files all load. One that does not (a truncated or
missing file) is skipped with a message naming it and why; if none loads, a ``ConfigError`` names
them. Every process picks its checkpoint itself; they must agree (the output directory must be on
storage all of them read), else a ``ConfigError``.

``SPECULANT_TEST_CHECKPOINT_PAUSE=SECONDS`` (for tests of the above): sleep that long inside each
checkpoint write, after the heads are written and before ``state.pt``, so a test can kill a run
in the middle of a write.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..heads import MedusaHeads, SequentialHeads, save_heads

__all__ = ["PAUSE_ENV", "find_checkpoint", "load_checkpoint", "resume", "save_checkpoint"]

PAUSE_ENV = "SPECULANT_TEST_CHECKPOINT_PAUSE"
STATE_KEYS = ("step", "optimizer", "scheduler", "fingerprint", "initial")


def say(msg: str) -> None:
    print(f"speculant: {msg}", file=sys.stderr, flush=True)


def save_checkpoint(ckpt_root: Path, step: int, heads: MedusaHeads | SequentialHeads, peft_model, state: dict,
                    keep: int) -> Path:
    """Write ``step-XXXXXXXX`` whole (a temporary directory renamed into place); keep the last
    ``keep``. Returns the checkpoint's directory."""
    final, tmp = ckpt_root / f"step-{step:08d}", ckpt_root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_heads(heads, tmp / "heads")
    if peft_model is not None:
        peft_model.save_pretrained(str(tmp / "lora"))
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    if pause > 0:
        time.sleep(pause)
    torch.save(state, tmp / "state.pt")  # written last
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in ckpt_root.glob("step-*") if (p / "state.pt").is_file())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> dict:
    """``{"state", "heads", "lora"}`` of the checkpoint ``path`` (``lora`` None without adapters);
    raises ``Unreadable`` naming the file that is missing, truncated or not a checkpoint's."""
    from safetensors.torch import load_file

    state = read(path, "state.pt", lambda f: torch.load(f, weights_only=True))
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise Unreadable(f"state.pt lacks {', '.join(missing)}")
    heads = read(path, "heads/model.safetensors", lambda f: load_file(str(f)))
    lora = (read(path, "lora/adapter_model.safetensors", lambda f: load_file(str(f)))
            if (path / "lora").exists() else None)
    return {"state": state, "heads": heads, "lora": lora}


class Unreadable(Exception):
    """A checkpoint's file is missing or damaged (the message names it)."""


def read(path: Path, name: str, load):
    f = path / name
    if not f.is_file():
        raise Unreadable(f"{name} is missing")
    try:
        return load(f)
    except Exception as e:  # whatever the reader says, the file cannot be trusted
        first = str(e).splitlines()[0] if str(e) else "no message"
        raise Unreadable(f"{name} is truncated or damaged: {type(e).__name__}: {first}") from e


def find_checkpoint(ckpt_root: Path, verbose: bool) -> tuple[Path, dict] | None:
    """The newest checkpoint under ``ckpt_root`` that loads, with its contents (``load_checkpoint``),
    or None if there is none; unreadable ones are skipped (``verbose``: saying which and why)."""
    bad = []
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        try:
            return path, load_checkpoint(path)
        except Unreadable as e:
            bad.append(f"{path.name} ({e})")
            if verbose:
                say(f"skipping checkpoint {path}: it cannot be read ({e})")
    if bad:
        raise ConfigError(f"no checkpoint in {ckpt_root} can be read: {'; '.join(bad)}. Move them away or delete "
                          "them, or pass --no-resume (resume=False) to start over")
    return None


def resume(run) -> None:
    """Continue ``run`` (a ``loop.TrainRun``) from its newest readable checkpoint made with the same
    settings if ``cfg.resume``, saying which in one line; then the held-out metrics before training,
    unless the checkpoint holds them."""
    accelerator, main = run.accelerator, run.accelerator.is_main_process
    found = None
    if run.cfg.resume:
        if main:
            for tmp in sorted(run.ckpt_root.glob(".tmp-step-*")):
                shutil.rmtree(tmp, ignore_errors=True)
                say(f"removed {tmp}: a checkpoint whose writing was interrupted")
        found = find_checkpoint(run.ckpt_root, verbose=main)
    agree(accelerator, int(found[1]["state"]["step"]) if found else -1, run.ckpt_root)
    if found is not None:
        path, ck = found
        state = ck["state"]
        if state["fingerprint"] != run.fingerprint:
            diff = sorted(k for k in run.fingerprint if state["fingerprint"].get(k) != run.fingerprint[k])
            raise ConfigError(f"cannot resume from {path}: it was made with other settings ({', '.join(diff)}); "
                              "use another output directory, or resume=False (--no-resume) to start over")
        run.core.heads.load_weights(ck["heads"])
        if run.peft_model is not None:
            from peft import set_peft_model_state_dict
            set_peft_model_state_dict(run.peft_model, ck["lora"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.step, run.initial = int(state["step"]), state["initial"]
        run.resumed_from = run.step
        run.history = list(state.get("history", []))
        run.train_loss = list(state.get("train_loss", []))
        if main:
            say(f"resuming from {path} (step {run.step} of {run.total})")
    if run.initial is None:
        run.initial = run.evaluate(joint=False) if run.held_batches else {}


def agree(accelerator, step: int, ckpt_root: Path) -> None:
    """Every process resumes from the same step, or a clear error (not a hang or a silent mix)."""
    if accelerator.num_processes == 1:
        return
    steps = accelerator.gather(torch.tensor([step], device=accelerator.device)).cpu().tolist()
    if len(set(steps)) > 1:
        raise ConfigError(f"the processes found different checkpoints in {ckpt_root} (steps {steps}; -1: none): "
                          "the output directory must be on storage every process reads")
