"""The README's headline is generated from clean bench runs (``bench-report --update-headline``):
what it says is what its runs say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.bench.headline import HEAD_BEGIN, HEAD_END, readme_headline, readme_runs, update_headline
from speculant.bench.report import summarize
from speculant.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_headline_is_what_its_runs_say():
    runs = readme_runs(ROOT / "README.md")
    assert runs, "the README has no generated headline"
    assert all((ROOT / link).is_file() for _, link in runs)
    written, made = readme_headline(ROOT / "README.md")
    assert written == made, ("README.md's headline differs from its runs: make it again with "
                             "`speculant bench-report --update-headline README.md --run LABEL=FILE.json ...`")


def _run(tmp_path, name, auto, auto_dec, peer, peer_dec, dirty=False, config=None) -> Path:
    runs = []
    for m, tps, dec in (("ar", 10.0, 20.0), ("auto", auto, auto_dec), ("llama-server", peer, peer_dec)):
        runs.append({"method": m, "question_id": 1, "category": "qa", "new_tokens": 10, "eos": False,
                     "wall_s": 10 / tps, "prefill_s": 10 / tps - 10 / dec, "tokens_per_s": tps,
                     "decode_tokens_per_s": dec, "token_ids": list(range(10)), "text": "x"})
    summary = summarize(runs, ("ar", "auto", "llama-server"), {0})
    path = tmp_path / name
    path.write_text(json.dumps({"runs": runs, "summary": summary, "dirty": dirty, "commit": "abcdef1234",
                                "date": "2026-12-04T05:00:00+00:00", "config": config or {}, "peers": {}}))
    return path


def test_update_headline_writes_each_cpu_from_its_run(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{HEAD_BEGIN}\nold text\n{HEAD_END}\nrest\n")
    a = _run(tmp_path, "a.json", 30.0, 60.0, 15.0, 40.0)
    update_headline(readme, [f"a CPU={a}"])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nrest\n") and "old text" not in text
    assert "2.00x (1.50x) over `llama-server` on [a CPU](a.json) (2026-12-04, abcdef1)" in text
    assert readme_runs(readme) == [("a CPU", "a.json")]
    written, made = readme_headline(readme)
    assert written == made
    _run(tmp_path, "a.json", 30.0, 60.0, 10.0, 40.0)  # the run changed: the block no longer says what it says
    written, made = readme_headline(readme)
    assert written != made and "3.00x" in made
    # each clause says which weights its run decoded
    b = _run(tmp_path, "b.json", 30.0, 60.0, 15.0, 40.0, config={"target_quant": "gguf"})
    c = _run(tmp_path, "c.json", 30.0, 60.0, 15.0, 40.0, config={"target_quant": "int4"})
    text = update_headline(readme, [f"one CPU={b}", f"another={c}"])
    assert "on [one CPU](b.json) (2026-12-04, abcdef1; the GGUF file's own blocks); 2.00x" in text
    assert "on [another](c.json) (2026-12-04, abcdef1; int4 weights)." in text


@pytest.mark.parametrize("spec, msg", [("nolabel.json", "LABEL=FILE.json"), ("x=a.txt", "LABEL=FILE.json")])
def test_bad_run_specs_are_refused(tmp_path, spec, msg):
    readme = tmp_path / "README.md"
    readme.write_text(f"{HEAD_BEGIN}\n{HEAD_END}\n")
    with pytest.raises(ConfigError, match=msg):
        update_headline(readme, [spec])


def test_dirty_runs_and_missing_markers_are_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    clean = _run(tmp_path, "clean.json", 30.0, 60.0, 15.0, 40.0)
    with pytest.raises(ConfigError, match="headline:begin"):
        update_headline(readme, [f"x={clean}"])
    readme.write_text(f"{HEAD_BEGIN}\n{HEAD_END}\n")
    dirty = _run(tmp_path, "dirty.json", 30.0, 60.0, 15.0, 40.0, dirty=True)
    with pytest.raises(ConfigError, match="uncommitted"):
        update_headline(readme, [f"x={dirty}"])
    assert readme.read_text() == f"{HEAD_BEGIN}\n{HEAD_END}\n"  # nothing half-written


def test_cli_update_headline(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"{HEAD_BEGIN}\n{HEAD_END}\n")
    a = _run(tmp_path, "a.json", 30.0, 60.0, 15.0, 40.0)
    done = subprocess.run([sys.executable, "-m", "speculant.cli", "bench-report", "--update-headline", str(readme),
                           "--run", f"a CPU={a}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "on [a CPU](a.json)" in readme.read_text()
    bad = subprocess.run([sys.executable, "-m", "speculant.cli", "bench-report", "--run", f"a CPU={a}"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--update-headline" in bad.stderr
