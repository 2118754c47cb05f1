"""The shipped drafters are data, not code (speculant.store.shipped): the data root's manifest matches
its files, the install step checks and copies them into the cache where the lookup finds them
first, and with no drafters anywhere a preset's lookup says in one line where to get them and
"auto" falls back to prompt lookup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speculant.store import shipped
from speculant.errors import ConfigError
from speculant.heads import shipped_heads
from speculant.planning import choose_method

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
PRESET = "qwen2.5-coder-1.5b-instruct"


def test_the_manifest_matches_every_shipped_file():
    files = shipped.read_manifest(DATA)
    assert any(p.endswith("eagle/model.safetensors") for p in files) and all(
        set(e) == {"size", "sha256"} and len(e["sha256"]) == 64 for e in files.values())
    assert shipped.check_data(DATA) == []


def test_the_package_carries_no_weights():
    """pyproject's package-data takes src/speculant/data/*: no weights may sit under src/."""
    weights = [p for ext in ("*.safetensors", "*.bin", "*.gguf", "*.pt") for p in (ROOT / "src").rglob(ext)]
    assert not weights, weights


def test_a_checkout_finds_its_data_root():
    assert shipped.checkout_data_root() == DATA
    assert shipped_heads(PRESET, "eagle") == DATA / "drafters" / PRESET / "eagle"  # the tests' cache is empty
    assert shipped_heads(PRESET, "medusa") == DATA / "drafters" / PRESET
    assert shipped_heads("smollm2-135m-instruct", "eagle") is None


def _small_root(tmp_path: Path) -> Path:
    """A data root of two presets with small files, its manifest written."""
    root = tmp_path / "data"
    for rel, text in {"a/config.json": "{}", "a/model.safetensors": "weights a", "a/eagle/config.json": "{}",
                      "b/sequential/config.json": "{}", "b/sequential/tree.json": "[[0]]"}.items():
        (root / "drafters" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "drafters" / rel).write_text(text)
    shipped.write_manifest(root)
    return root


def test_install_checks_copies_and_the_cache_comes_first(tmp_path, monkeypatch):
    root = _small_root(tmp_path)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    assert shipped.install_drafters(root) == ["a", "b"]
    cache = tmp_path / "cache" / "drafters"
    assert (cache / "a" / "model.safetensors").read_text() == "weights a"
    assert shipped.read_manifest(cache) == shipped.read_manifest(root)
    assert shipped.find_drafter("a", "eagle") == cache / "a" / "eagle"
    assert shipped.find_drafter("b", "sequential") == cache / "b" / "sequential"
    assert shipped.find_drafter("b", "eagle") is None
    assert shipped.install_drafters(root) == []  # already there

    (root / "drafters" / "a" / "model.safetensors").write_text("weights A")  # same size, another hash
    with pytest.raises(ConfigError, match="a/model.safetensors: SHA-256"):
        shipped.install_drafters(root)
    assert (cache / "a" / "model.safetensors").read_text() == "weights a"  # the installed copy kept
    shipped.write_manifest(root)  # shipped anew: installed anew, that preset only
    assert shipped.install_drafters(root) == ["a"]
    assert (cache / "a" / "model.safetensors").read_text() == "weights A"

    (root / "drafters" / "b" / "sequential" / "extra.json").write_text("{}")
    assert shipped.check_data(root) == ["drafters/b/sequential/extra.json: not in manifest.json "
                                        "(run tools/data_manifest.py write)"]
    shutil.rmtree(root / "drafters" / "b")
    assert any("drafters/b/sequential/tree.json: missing" in p for p in shipped.check_data(root))


def test_with_no_drafters_anywhere_one_line_says_where_and_auto_takes_lookup(tmp_path, monkeypatch, capsys):
    """A wheel-only install: no checkout data root, nothing installed in the cache."""
    monkeypatch.setattr(shipped, "checkout_data_root", lambda: None)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    shipped.say_not_installed.cache_clear()
    assert shipped_heads(PRESET, "sequential") is None and shipped_heads(PRESET, "eagle") is None
    choice = choose_method("auto", PRESET, has_draft=False, lookup_branch=0)
    assert choice.method == "lookup" and "no heads ship" in choice.why
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`make install` in a checkout" in err, err
    assert str(tmp_path / "cache" / "drafters") in err

    shipped.say_not_installed.cache_clear()
    assert shipped_heads("my-own-model", "sequential") is None  # not a preset: nothing ships to get
    assert shipped_heads("/models/" + PRESET, "sequential") is None  # a path, not a name
    assert capsys.readouterr().err == ""

    cache = tmp_path / "cache" / "drafters"  # installed, but nothing for this preset: nothing to say
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({"files": {}}))
    assert shipped_heads(PRESET, "sequential") is None and capsys.readouterr().err == ""
