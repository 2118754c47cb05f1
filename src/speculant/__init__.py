"""speculant: lossless speculative decoding for causal language models.

    import speculant
    dec = speculant.SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                       method="mcsd", tree="4x2x2x1")
    result = dec.generate("def fib(n):", max_new_tokens=64)
    print(result.text, result.stats.to_dict())
"""

from .api import Generation, GenerationResult, SpeculativeDecoder, TokenEvent, generate
from .config import AcceptanceConfig, DecoderConfig, SamplingConfig
from .errors import ConfigError, ModelLoadError, SpeculantError, VocabMismatchError
from .store.models import load
from .runtime.process import tune_allocator

__all__ = ["load", "generate", "SpeculativeDecoder", "DecoderConfig", "Generation", "GenerationResult", "TokenEvent",
           "SamplingConfig", "AcceptanceConfig", "SpeculantError", "ConfigError", "ModelLoadError",
           "VocabMismatchError", "tune_allocator"]
__version__ = "0.1.0"
