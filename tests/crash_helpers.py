"""Running a child Python process, waiting (bounded) until it reaches a chosen point, and killing it
with SIGKILL: the crash tests' tools. Every wait has a deadline, so a test fails instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Child:
    """``python -c code *args`` in its own session (so killing it and its children never touches
    pytest), with standard output and error written to files next to ``log``."""

    def __init__(self, code: str, *args: str | os.PathLike, log: Path, env: dict[str, str] | None = None):
        self.out, self.err = log.with_suffix(".out"), log.with_suffix(".err")
        full_env = {k: v for k, v in os.environ.items() if k not in ("SPECULANT_NO_KERNELS", "SPECULANT_INT4_ISA")}
        full_env.update(env or {})
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=out, stderr=err,
                                         env=full_env, start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()

    def stdout(self) -> str:
        return self.out.read_text()

    def wait_until(self, ready, timeout: float, what: str) -> None:
        """Poll ``ready()`` every 20 ms until it is true; fail (killing the child) if the child
        exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the child exited ({self.proc.returncode}) before {what}:\n{self.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the child did not reach {what} in {timeout:.0f} s:\n{self.stderr()[-3000:]}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the child and every process it started (its session), and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def finish(self, timeout: float) -> int:
        """Wait for the child to exit (killing it after ``timeout`` s, which fails the test)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the child did not finish in {timeout:.0f} s:\n{self.stderr()[-3000:]}") from None


def visible(directory: Path) -> list[str]:
    """The names in ``directory``, sorted (hidden ones too: leftovers are what these tests look for)."""
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
