"""The drafters shipped for preset models (heads and EAGLE drafters): weights are data, not code.

They live in the repository's data root, ``data/`` at its top, beside the corpora and the
training data::

    data/manifest.json                 every file under drafters/: {"path": {"size", "sha256"}}
    data/drafters/<preset>/            Medusa heads (config.json, model.safetensors, tree.json ...)
    data/drafters/<preset>/sequential/ sequential (Hydra) heads
    data/drafters/<preset>/eagle/      an EAGLE drafter (with accuracy.json, which "auto" reads)
    data/corpora/  data/training/      what they were trained on (not installed)

The wheel carries none of them. The project's install step (``make install``, i.e.
``tools/data_manifest.py install``) checks each file's size and SHA-256 against the manifest and
copies the drafters into the cache, ``$SPECULANT_CACHE/drafters/`` (default
``~/.cache/speculant``), one preset at a time through a temporary directory renamed into place.
:func:`find_drafter` looks there first, then in a source checkout's own data root (an editable
install that has not run the install step). Where neither holds any drafter, a lookup for a
preset says once, on one line, where to get them (:data:`NOT_INSTALLED`) and finds nothing:
"auto" then decodes with prompt lookup, as for a model no drafter ships for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError

__all__ = ["DRAFTERS", "MANIFEST_NAME", "NOT_INSTALLED", "check_data", "checkout_data_root", "find_drafter",
           "install_drafters", "installed_root", "read_manifest", "say_not_installed", "sha256_file",
           "write_manifest"]

MANIFEST_NAME = "manifest.json"
DRAFTERS = "drafters"  # the data root's folder of drafters, and the cache's
SUBFOLDERS = ("sequential", "eagle")  # kinds with a folder of their own in the preset's; Medusa heads: the preset's
NOT_INSTALLED = ("speculant: the drafters shipped for the presets are not installed (the wheel carries code only): "
                 "run `make install` in a checkout of the speculant repository to copy them into {where}; "
                 "until then `auto` falls back to prompt lookup")
_CHUNK = 8 << 20


def checkout_data_root() -> Path | None:
    """``data/`` at the top of the source checkout this package is imported from (``src/speculant``
    two levels down), or None when there is none (an installed wheel)."""
    root = Path(__file__).resolve().parents[3] / "data"
    return root if (root / MANIFEST_NAME).is_file() and (root / DRAFTERS).is_dir() else None


def installed_root() -> Path:
    """Where the install step puts the drafters: ``$SPECULANT_CACHE/drafters`` (it holds
    ``<preset>/...`` and the manifest it was installed from)."""
    from ..runtime.process import cache_dir

    return cache_dir() / DRAFTERS


def _kind_dir(base: Path, target_name: str, kind: str) -> Path:
    d = base / target_name
    return d / kind if kind in SUBFOLDERS else d


def find_drafter(target_name: str, kind: str = "medusa") -> Path | None:
    """The directory of the ``kind`` drafter shipped for ``target_name`` (installed in the cache,
    else in this checkout's data root), or None when none is there. Says :data:`NOT_INSTALLED`
    once when ``target_name`` is a preset and no drafter is installed anywhere."""
    from ..heads.checkpoint import CONFIG_NAME
    from .presets import PRESETS

    if Path(target_name).name != target_name or target_name.startswith("."):
        return None  # a path, not a model's name: nothing ships under it
    cache, checkout = installed_root(), checkout_data_root()
    for base in (cache, checkout / DRAFTERS if checkout else None):
        if base is not None and (d := _kind_dir(base, target_name, kind)).joinpath(CONFIG_NAME).is_file():
            return d
    if target_name in PRESETS and checkout is None and not (cache / MANIFEST_NAME).is_file():
        say_not_installed(str(cache))
    return None


@functools.cache
def say_not_installed(where: str) -> None:
    """Print :data:`NOT_INSTALLED` for the cache folder ``where``, once a process."""
    print(NOT_INSTALLED.format(where=where), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The manifest and the install step (tools/data_manifest.py)
# --------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(root: Path) -> dict[str, dict]:
    """``root``'s manifest: {path relative to root: {"size": bytes, "sha256": hex}}."""
    try:
        files = json.loads((Path(root) / MANIFEST_NAME).read_text("utf-8"))["files"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{Path(root) / MANIFEST_NAME}: no manifest of the data root there ({e})") from None
    return files


def _data_files(root: Path) -> list[str]:
    """Every file under ``root/drafters`` (relative to ``root``), sorted; hidden ones (a run's
    temporary files) left out."""
    base = Path(root) / DRAFTERS
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames if not f.startswith(".")]
    return sorted(out)


def write_manifest(root: Path) -> dict[str, dict]:
    """Write ``root/manifest.json`` for the files under ``root/drafters`` as they are; returns its files."""
    root = Path(root)
    files = {p: {"size": (root / p).stat().st_size, "sha256": sha256_file(root / p)} for p in _data_files(root)}
    doc = {"what": "every file under drafters/ with its size in bytes and SHA-256; `make install` checks them "
                   "and copies the drafters into $SPECULANT_CACHE/drafters (tools/data_manifest.py)",
           "files": files}
    tmp = root / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
    tmp.replace(root / MANIFEST_NAME)
    return files


def check_data(root: Path, unlisted: bool = True) -> list[str]:
    """What is wrong with ``root``'s drafters against its manifest, one line each (empty: nothing):
    files missing or of another size or hash, and with ``unlisted`` files the manifest lacks."""
    root = Path(root)
    listed = read_manifest(root)
    problems = []
    for path, want in listed.items():
        f = root / path
        if not f.is_file():
            problems.append(f"{path}: missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{path}: {f.stat().st_size} bytes, the manifest says {want['size']}")
        elif sha256_file(f) != want["sha256"]:
            problems.append(f"{path}: SHA-256 {sha256_file(f)[:12]}..., the manifest says {want['sha256'][:12]}...")
    if unlisted:
        problems += [f"{p}: not in {MANIFEST_NAME} (run tools/data_manifest.py write)" for p in _data_files(root)
                     if p not in listed]
    return problems


def install_drafters(root: Path, dest: Path | None = None) -> list[str]:
    """Check ``root``'s drafters against its manifest, then copy each preset's files the manifest
    lists (and no other) into ``dest`` (default :func:`installed_root`), each copy checked again,
    unless the copy there was installed from the same manifest entries; returns the presets copied. Raises ConfigError
    naming every file that does not match."""
    from ..runtime.process import file_lock

    root, dest = Path(root), Path(dest) if dest is not None else installed_root()
    problems = check_data(root, unlisted=False)
    if problems:
        raise ConfigError(f"{root}: the drafters do not match {MANIFEST_NAME}: " + "; ".join(problems))
    listed = read_manifest(root)
    by_preset: dict[str, dict[str, dict]] = {}
    for path, entry in listed.items():
        by_preset.setdefault(Path(path).parts[1], {})[path] = entry
    copied = []
    with file_lock(dest / ".install.lock"):
        try:
            before = read_manifest(dest)
        except ConfigError:
            before = {}
        for preset, entries in sorted(by_preset.items()):
            there = {p: e for p, e in before.items() if Path(p).parts[1] == preset}
            if there == entries and all((dest / Path(p).relative_to(DRAFTERS)).is_file() for p in entries):
                continue  # installed from the same entries
            tmp = Path(tempfile.mkdtemp(prefix=f".{preset}.", dir=dest))
            for path, entry in entries.items():
                to = tmp / Path(path).relative_to(DRAFTERS)
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / path, to)
                if sha256_file(to) != entry["sha256"]:  # changed since the check, or copied wrong
                    shutil.rmtree(tmp)
                    raise ConfigError(f"{root / path}: its copy in {dest} does not match {MANIFEST_NAME}")
            old = dest / preset
            if old.exists():
                old.rename(tmp / ".old")
            (tmp / preset).rename(old)
            shutil.rmtree(tmp)
            copied.append(preset)
        for stale in sorted({Path(p).parts[1] for p in before} - set(by_preset)):
            shutil.rmtree(dest / stale, ignore_errors=True)
        doc = {"what": f"the manifest {root / MANIFEST_NAME} these drafters were installed from", "files": listed}
        (dest / f".{MANIFEST_NAME}.tmp").write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
        (dest / f".{MANIFEST_NAME}.tmp").replace(dest / MANIFEST_NAME)
    return copied
