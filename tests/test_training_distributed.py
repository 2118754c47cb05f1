"""`speculant train-heads` under `accelerate launch` with two CPU processes (gloo over loopback):
the loss curve of 2 processes x batch b equals one process's with batch 2b, checkpoints are written
once and whole, and a run stopped (--stop-after) or SIGKILLed in the middle of a checkpoint write
resumes on two processes to the uninterrupted run's curve and heads.

Tolerance: the two runs score the same rows in every step and weight every loss term by the
process's share of the global batch (``training.loop``), so they compute the same function; they
differ only in the order fp32 sums are taken (a mean over 64 rows vs two sums over 32 added by
the all-reduce, the gradient matmuls likewise). Measured: 1.6e-7 relative on the losses, 4e-8 on
the weights after 12 Adam steps; the test allows 1e-5 and 1e-6."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tiny import tiny_model_dir

V = 64
PATTERN = [5, 17, 9, 33, 2, 41, 12, 27, 50, 8, 19]
STEPS, SAVE_EVERY, STOP = 12, 4, 8
LAUNCH_TIMEOUT = 180  # seconds, per launch (a launch takes ~15 s on 2 cores)


def train_args(out, data, model, rows: int) -> list[str]:
    return ["train-heads", "--target", str(model), "--dtype", "float32", "--data", str(data), "--skip-distill",
            "--out", str(out), "--num-heads", "3", "--rows-per-batch", str(rows), "--steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--lr-heads", "1e-2", "--held-out", "0.25", "--seq-len", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(args: list[str]) -> list[str]:
    """`accelerate launch` of two CPU processes on this interpreter. accelerate 1.15 starts several
    CPU processes only through torchrun (--multi_gpu) with ACCELERATE_USE_CPU set (`--cpu
    --num_processes 2` without an MPI host file starts one)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
            "-m", "speculant.cli", *args]


def launch_env(tmp_path, **extra) -> dict:
    env = dict(os.environ, ACCELERATE_USE_CPU="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), **extra)  # HF_HOME: no accelerate config of the user's
    env.pop("WORLD_SIZE", None)
    return env


def run_launch(args, tmp_path, **extra) -> str:
    p = subprocess.run(launch_cmd(args), env=launch_env(tmp_path, **extra), capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT)
    log = (p.stdout + p.stderr).replace("\r", "\n")
    assert p.returncode == 0, log[-3000:]
    return log


def report(out) -> dict:
    return json.loads((out / "training_report.json").read_text())


def listing(out) -> list[str]:
    return sorted(os.listdir(out / "checkpoints"))


def assert_same_heads(a, b) -> None:
    wa, wb = (load_file(str(d / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    model = tiny_model_dir(d / "model", seed=0, vocab=V)
    recs = [{"prompt": f"r{i}", "prompt_len": 4, "ids": [PATTERN[(i + j) % len(PATTERN)] for j in range(44)]}
            for i in range(16)]
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d, model, data


@pytest.mark.slow
def test_two_processes_follow_one_and_resume_after_stop_and_kill(setup, tmp_path, capsys):
    import psutil

    from speculant.cli.commands import main

    d, model, data = setup
    # the reference: one process, global batch 64 rows, uninterrupted
    ref = tmp_path / "one"
    assert main(train_args(ref, data, model, rows=64)) == 0
    capsys.readouterr()
    want = report(ref)
    assert want["processes"] == 1 and len(want["train_loss"]) == STEPS

    # two processes x 32 rows, stopped after step 8
    out = tmp_path / "two"
    log = run_launch(train_args(out, data, model, rows=32) + ["--stop-after", str(STOP)], tmp_path)
    first = report(out)
    assert first["processes"] == 2 and first["step"] == STOP and not first["finished"]
    for key in ("per_head_loss", "top1", "top5"):  # held-out chunks (of --rows-per-batch) shared out, summed
        assert first["initial"][key] == pytest.approx(want["initial"][key], rel=1e-6)
    assert first["initial"]["positions"] == want["initial"]["positions"]
    assert first["train_loss"] == pytest.approx(want["train_loss"][:STOP], rel=1e-5)
    assert first["train_loss"][-1] < 0.85 * first["train_loss"][0]  # it learns (the curves are not flat)
    assert listing(out) == ["step-00000004", "step-00000008"]
    for step in (4, 8):  # written once, by one process
        assert log.count(f"checkpoint {out / 'checkpoints' / f'step-{step:08d}'} (step {step})") == 1

    # relaunch; SIGKILL the writing process (rank 0) while it writes step 12's checkpoint
    pause = {"SPECULANT_TEST_CHECKPOINT_PAUSE": "120"}
    tmp_ckpt = out / "checkpoints" / ".tmp-step-00000012"
    launcher = subprocess.Popen(launch_cmd(train_args(out, data, model, rows=32)), env=launch_env(tmp_path, **pause),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (tmp_ckpt / "heads" / "model.safetensors").is_file():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run never began step 12's checkpoint"
            time.sleep(0.2)
        workers = [c for c in psutil.Process(launcher.pid).children(recursive=True)
                   if "speculant.cli" in " ".join(c.cmdline())]
        writer = [c for c in workers if c.environ().get("RANK") == "0"]
        assert len(workers) == 2 and len(writer) == 1
        os.kill(writer[0].pid, signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    assert listing(out) == [".tmp-step-00000012", "step-00000004", "step-00000008"]
    assert not (tmp_ckpt / "state.pt").exists()

    # relaunch on two processes: the partial checkpoint is dropped, step 8 resumed, the curve continues
    log = run_launch(train_args(out, data, model, rows=32), tmp_path)
    assert f"removed {tmp_ckpt}: a checkpoint whose writing was interrupted" in log
    assert log.count("resuming from") == 1
    assert f"resuming from {out / 'checkpoints' / 'step-00000008'} (step 8 of 12)" in log
    got = report(out)
    assert got["processes"] == 2 and got["step"] == STEPS and got["resumed_from"] == STOP and got["finished"]
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert got["final"]["loss"] == pytest.approx(want["final"]["loss"], rel=1e-5)
    assert got["final"]["top1"] == pytest.approx(want["final"]["top1"], abs=1e-6)
    assert_same_heads(out, ref)
    assert listing(out) == ["step-00000008", "step-00000012"]


def test_several_processes_refuse_to_distil(tmp_path, monkeypatch, capsys):
    """Each process would append the same answers to one file: a clear error before any work."""
    from speculant.cli.commands import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train-heads", "--target", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "several processes can train but not distil" in err and "--skip-distill" in err


def test_one_process_from_accelerate_cpu_launch_is_pointed_out(monkeypatch, capsys):
    """`accelerate launch --cpu --num_processes 2` (no MPI) starts one process: say so, and how to get two."""
    from speculant.training.train import warn_one_cpu_process

    for k in ("LOCAL_RANK", "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what `--num_processes 2` sets
    warn_one_cpu_process(1)
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N" in capsys.readouterr().err
    warn_one_cpu_process(2)  # really two processes
    monkeypatch.setenv("LOCAL_RANK", "0")
    warn_one_cpu_process(1)  # torchrun with one process: nothing to point out
    assert capsys.readouterr().err == ""
