"""Benchmark harness: Hydra entry point, models, datasets, scorers and reports."""
