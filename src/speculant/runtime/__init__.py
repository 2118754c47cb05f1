"""Running a model fast on a CPU: the KV cache, low-bit weights and their packing, process settings."""
