"""Model runtimes behind the Backend protocol (see base.py): hf.py (any transformers causal LM)
and native.py (speculant's own Llama / Qwen2 forward with a static KV cache)."""

from .base import Backend, ForwardOut
from .hf import HFBackend
from .native import NativeBackend, NativeModel

__all__ = ["Backend", "ForwardOut", "HFBackend", "NativeBackend", "NativeModel"]
