"""Running a model fast on a CPU: the KV caches, low-bit weights (GGUF's blocks among them) and their
packing, process settings."""
