"""Benchmarks behind `qladder bench ...`; each prints JSON with its environment recorded."""
