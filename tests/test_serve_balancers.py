"""The load-balancer configurations in docs/serve.md ("Prefix cache and multi-turn sessions":
pinning a conversation to a replica) are valid: every ``haproxy`` block passes ``haproxy -c``
and every ``nginx`` block ``nginx -t``. Skipped where the program is not installed (Debian:
``apt-get install haproxy nginx-light``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "serve.md"
BLOCK = re.compile(r"^```(haproxy|nginx)\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[str]:
    found = [text for k, text in BLOCK.findall(DOC.read_text(encoding="utf-8")) if k == kind]
    assert found, f"docs/serve.md has no {kind} block"
    return found


def program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed here (apt-get install {name if name == 'haproxy' else 'nginx-light'})")
    return path


def test_the_haproxy_configurations_are_valid(tmp_path):
    haproxy = program("haproxy")
    for i, text in enumerate(blocks("haproxy")):
        assert "hash-type consistent" in text
        conf = tmp_path / f"haproxy{i}.cfg"
        conf.write_text(text)
        run = subprocess.run([haproxy, "-c", "-f", str(conf)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr


def test_the_nginx_configuration_is_valid(tmp_path):
    nginx = program("nginx")
    for i, text in enumerate(blocks("nginx")):
        assert "consistent;" in text
        conf = tmp_path / f"nginx{i}.conf"
        conf.write_text(text)
        # its own prefix, pid file and log: the check writes nothing outside tmp_path
        run = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(conf),
                              "-g", f"error_log stderr; pid {tmp_path / 'nginx.pid'};"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
