"""The shipped drafters of the data root (``data/``) and their manifest (``data/manifest.json``).

    python tools/data_manifest.py install   # check every file against the manifest, then copy the
                                            # drafters into $SPECULANT_CACHE/drafters (`make install`)
    python tools/data_manifest.py check     # only check (exit 1 naming each file that does not match)
    python tools/data_manifest.py write     # rewrite the manifest for the files as they are (after
                                            # shipping new weights, e.g. `make drafter`)

``--root DIR`` names another data root. The layout and the lookup: ``speculant/shipped.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speculant.errors import ConfigError
from speculant.store.shipped import check_data, install_drafters, installed_root, read_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[1] / "data"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="data_manifest.py", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("install", "check", "write"))
    p.add_argument("--root", type=Path, default=ROOT, help=f"the data root (default: {ROOT})")
    args = p.parse_args(argv)
    try:
        if args.action == "write":
            files = write_manifest(args.root)
            print(f"data_manifest: {len(files)} files in {args.root / 'manifest.json'}", file=sys.stderr)
        elif args.action == "check":
            problems = check_data(args.root)
            for line in problems:
                print(f"data_manifest: {line}", file=sys.stderr)
            if problems:
                return 1
            print(f"data_manifest: {len(read_manifest(args.root))} files match", file=sys.stderr)
        else:
            copied = install_drafters(args.root)
            print(f"data_manifest: drafters checked and installed in {installed_root()} "
                  f"({', '.join(copied) + ' copied' if copied else 'already there'})", file=sys.stderr)
    except ConfigError as e:
        print(f"data_manifest: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
