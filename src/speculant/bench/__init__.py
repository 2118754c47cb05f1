"""Benchmark harness (Spec-Bench prompts) and the demo."""
