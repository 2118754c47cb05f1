"""Checks of the paths a command will write, made before the work that fills them (a bench, a
training run, loading a model): a path that cannot be written fails at once, with what to change,
not after the work."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a file this command can create or replace: its directory exists and is
    writable, and it is not a directory itself. ``option``: the flag that named it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {p} is a directory: give a file name in it, e.g. {p / 'out.json'}")
    parent = p.parent
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{option} {p}: the directory {parent}/ {what} (create it or pick another path)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {p}: the directory {parent}/ is not writable (pick another path)")
    return p


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a directory this command can write in: an existing writable directory, or one
    that can be created (its nearest existing ancestor is a writable directory). Nothing is made."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{option} {p} is a file, not a directory: give a directory to write in")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{option} {p}/ is not writable (pick another directory)")
        return p
    ancestor = p.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"cannot create {option} {p}: {ancestor} is a file, not a directory (pick another path)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create {option} {p}: {ancestor}/ is not writable (pick another path)")
    return p
