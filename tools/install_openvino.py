"""Install the OpenVINO GenAI benchmark peer (`make install-openvino`); idempotent.

1. A virtual environment of its own at ``$SPECULANT_CACHE/peers/openvino-venv`` with pinned
   versions: OpenVINO's packages pull transformers 5.5.x, which conflicts with the project's
   pinned transformers, so they never share the project's interpreter. The bench talks to them
   through a subprocess (``speculant/bench/openvino_worker.py``).
2. Both Qwen presets exported once to int4 OpenVINO IR from the project's own bf16 safetensors
   cache, at ``$SPECULANT_CACHE/peers/openvino-ir/<preset>-int4``, with the exact command, options
   and versions in ``speculant_export.json`` beside the IR. ``--model SPEC`` (repeatable) exports
   those models instead: any spec speculant loads (a preset, a .gguf file, a transformers
   directory), to the directory the bench looks in (``speculant.bench.openvino.ir_dir``), e.g.
   ``python tools/install_openvino.py --model target.gguf --model draft.gguf`` for
   ``speculant bench --target target.gguf --draft draft.gguf``.

Both steps are atomic: the venv counts as installed only once its marker (written last) matches
the pins, and an export is written into a hidden temporary directory and renamed into place at
the end. Run with the project's interpreter (it resolves the presets through ``speculant.store.models``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from speculant.bench.openvino import ir_dir
from speculant.store.models import cache_dir, resolve

# the CPU wheel, installed FIRST and kept by a constraint: a bare `torch` could pull a CUDA build
TORCH = "torch==2.13.0"
PINS = [
    "openvino==2026.4.1",
    "openvino-genai==2026.4.1.0",
    "openvino-tokenizers==2026.4.1.0",
    "optimum-intel==2.2.0",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "transformers==5.5.4",
]
PRESETS = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
EXPORT_OPTIONS = ["--task", "text-generation-with-past", "--weight-format", "int4"]
MARKER = "speculant-openvino.json"  # inside the venv, written last
EXPORT_RECORD = "speculant_export.json"  # inside each IR directory, written before the rename
REPORTED = ["openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "optimum", "nncf",
            "transformers", "torch"]


def say(msg: str) -> None:
    print(f"install-openvino: {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> None:
    say("$ " + " ".join(map(str, cmd)))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_versions(py: Path) -> dict:
    code = ("import json, importlib.metadata as m\n"
            f"names = {REPORTED!r}\n"
            "out = {}\n"
            "for n in names:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    return json.loads(subprocess.run([str(py), "-I", "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def ensure_venv(venv: Path) -> dict:
    want = {"torch": TORCH, "pins": PINS}
    marker = venv / MARKER
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except ValueError:
            have = {}
        if {k: have.get(k) for k in want} == want and venv_python(venv).exists():
            say(f"venv up to date: {venv}")
            return have["versions"]
    if venv.exists():
        say(f"rebuilding {venv} (missing or stale marker)")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", venv])
    py = venv_python(venv)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(pip + [TORCH])
    constraints = venv / "torch-constraint.txt"
    constraints.write_text(TORCH + "\n")
    run(pip + ["-c", constraints] + PINS)
    # optimum-intel requires torchvision, and the one pip resolves does not match the CPU torch:
    # importing transformers' PreTrainedModel then fails ("operator torchvision::nms does not
    # exist") and optimum-cli cannot export. Nothing here needs torchvision.
    run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision"])
    run([py, "-I", "-c", "import openvino_genai, optimum.exporters.openvino, torch; "
         "assert torch.__version__.startswith('2.13.0'), torch.__version__"])
    versions = installed_versions(py)
    marker.write_text(json.dumps({**want, "versions": versions}, indent=2) + "\n")
    say(f"venv ready: {versions}")
    return versions


def ensure_ir(venv: Path, ir_root: Path, spec: str, versions: dict) -> Path:
    """Export model ``spec`` (a preset, a .gguf file, a transformers directory) to ``ir_dir(spec)``,
    which lies under ``ir_root``."""
    out = ir_dir(spec)
    assert out.parent == ir_root, (out, ir_root)
    src = resolve(spec, "bfloat16")  # the project's safetensors cache (converted once if needed)
    recipe = {"source": str(src), "options": EXPORT_OPTIONS, "versions": versions}
    record = out / EXPORT_RECORD
    if record.is_file():
        try:
            have = json.loads(record.read_text())
        except ValueError:
            have = {}
        if {k: have.get(k) for k in recipe} == recipe and (out / "openvino_model.xml").is_file():
            say(f"IR up to date: {out}")
            return out
    ir_root.mkdir(parents=True, exist_ok=True)
    tmp = ir_root / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [venv / "bin" / "optimum-cli", "export", "openvino", "--model", src, *EXPORT_OPTIONS, tmp]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    t = time.time()
    tmp.mkdir()
    with open(tmp / "export.log", "w") as log:
        say("$ " + " ".join(map(str, cmd)) + f"  (log: {out / 'export.log'})")
        rc = subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not (tmp / "openvino_model.xml").is_file():
        tail = (tmp / "export.log").read_text()[-3000:]
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"install-openvino: export of {spec} failed (exit {rc}):\n{tail}")
    ov_config = json.loads((tmp / "openvino_config.json").read_text()) if (tmp / "openvino_config.json").is_file() else None
    (tmp / EXPORT_RECORD).write_text(json.dumps({
        **recipe,
        "model": str(spec),
        "command": ["optimum-cli", "export", "openvino", "--model", str(src), *EXPORT_OPTIONS, str(out)],
        # nncf's own summary of the compression it applied (mode: % of parameters (layers))
        "weights": [" ".join(line.replace("│", " ").split()) for line in
                    (tmp / "export.log").read_text().splitlines()
                    if line.startswith("│") and "Weight compression mode" not in line],
        "openvino_config": ov_config,
        "seconds": round(time.time() - t, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }, indent=2) + "\n")
    if out.exists():
        old = ir_root / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(out)
    say(f"exported {spec} in {time.time() - t:.0f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None, metavar="SPEC",
                   help="export this model (a preset, a .gguf file, a transformers directory) instead of the "
                        "Qwen presets; repeat for a target and its draft")
    models = p.parse_args(argv).model or PRESETS
    peers = cache_dir() / "peers"
    venv = peers / "openvino-venv"
    versions = ensure_venv(venv)
    for spec in models:
        ensure_ir(venv, peers / "openvino-ir", spec, versions)
    say("done")


if __name__ == "__main__":
    main()
