"""Models on disk: presets, GGUF assembly and conversion, loading onto a runtime, LoRA, shipped drafters."""
