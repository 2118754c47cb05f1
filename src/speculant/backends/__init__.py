"""Model runtimes behind the Backend protocol (see base.py)."""

from .base import Backend, ForwardOut
from .hf import HFBackend

__all__ = ["Backend", "ForwardOut", "HFBackend"]
