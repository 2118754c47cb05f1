"""Model runtimes behind the Backend protocol (see base.py): hf.py (any transformers causal LM)
and native.py (speculant's own decoder forward, backends.native_arch's families, with a static KV cache)."""

from .base import Backend, ForwardOut
from .hf import HFBackend
from .native import NativeBackend, NativeModel

__all__ = ["Backend", "ForwardOut", "HFBackend", "NativeBackend", "NativeModel"]
