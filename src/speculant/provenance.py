"""Where a measurement comes from: the machine (CPU model and the ISA flags that matter, cores,
torch's threads; environment variables that cap the instructions used) and the source (the git
commit, uncommitted changes with their diff's hash, a change during the run), and the command
line. Read by the bench, the training and the corpus tools alike."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["CAPPING_ENV", "CPU_FLAGS", "command_line", "git_info", "machine_info", "provenance",
           "provenance_warning"]

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "fma")


def machine_info() -> dict:
    """CPU model, its relevant ISA flags, cores, torch's threads and version."""
    cpu: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and cpu is None:
                cpu = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    info = {"cpu": cpu, "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    capped = {k: os.environ[k] for k in CAPPING_ENV if os.environ.get(k)}
    if capped:  # the run used fewer of the CPU's instructions than it has
        info["env"] = capped
    return info


# environment variables that make speculant (or the peers' oneDNN) use fewer instructions than the
# CPU has; a run under any of them records it, and is not taken as the machine's own result
CAPPING_ENV = ("SPECULANT_NO_AMX", "SPECULANT_INT4_ISA", "SPECULANT_NO_KERNELS", "SPECULANT_EXACT_PREFILL",
               "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def git_info() -> dict:
    """``commit``: HEAD of the git repository this package's source is tracked in, and ``dirty``:
    whether its tracked files have changes; both None when the package is not run from a checkout."""
    here = Path(__file__).resolve()
    none = {"commit": None, "dirty": None}

    def git(*args):
        return subprocess.run(["git", "-C", str(here.parent), *args], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)

    try:
        if git("ls-files", "--error-unmatch", here.name).returncode != 0:
            return none  # an installed copy (or no git): whatever repository holds it is not its source
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return none
    if head.returncode != 0:
        return none
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    out = {"commit": head.stdout.strip(), "dirty": dirty}
    if dirty:  # which uncommitted changes: the hash of the tracked files' diff against HEAD
        diff = subprocess.run(["git", "-C", str(here.parent), "diff", "HEAD", "--binary"], capture_output=True,
                              timeout=60, stdin=subprocess.DEVNULL)
        out["diff_sha256"] = hashlib.sha256(diff.stdout).hexdigest() if diff.returncode == 0 else None
    return out


def provenance(before: dict, after: dict) -> dict:
    """The source a run measured, from :func:`git_info` at its start and at its end: the commit,
    ``dirty`` (uncommitted changes at either end, with the diff's hash), and ``changed_during_run``
    when the source differed between the two (a result then measured neither)."""
    out = dict(after)
    out["dirty"] = bool(before.get("dirty") or after.get("dirty")) if after.get("commit") else None
    if before.get("diff_sha256") and not after.get("diff_sha256"):
        out["diff_sha256"] = before["diff_sha256"]
    if (before.get("commit"), before.get("diff_sha256")) != (after.get("commit"), after.get("diff_sha256")):
        out["changed_during_run"] = True
    return out


def provenance_warning(info: dict) -> str | None:
    """One line saying why a result is not a clean commit's, or None."""
    if info.get("changed_during_run"):
        return "the source changed while the bench ran: this result measured no single version of speculant"
    if info.get("dirty"):
        return (f"the tree has uncommitted changes (diff sha256 {str(info.get('diff_sha256'))[:12]}): this result "
                f"is not commit {str(info.get('commit'))[:8]}'s; commit first for a result to publish")
    return None


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran: ``speculant`` and ``argv`` (default: this process's arguments; a
    module run as a script keeps its own path)."""
    if argv is None:
        if Path(sys.argv[0]).name not in ("speculant", "cli.py", "commands.py", "__main__.py"):
            return shlex.join(["python", *sys.argv])
        argv = sys.argv[1:]
    return shlex.join(["speculant", *argv])
