"""``python -m speculant.cli``."""

from .commands import main

raise SystemExit(main())
