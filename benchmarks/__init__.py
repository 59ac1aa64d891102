"""Benchmarks, run from the repository root as ``python -m benchmarks.<name>`` (see docs/performance.md)."""
