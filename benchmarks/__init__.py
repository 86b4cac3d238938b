"""hopperkern benchmarks, tuner and stored results (run from the repository root: python -m benchmarks.run)."""
