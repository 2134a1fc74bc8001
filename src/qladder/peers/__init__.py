"""Serving engines teams already run, started and driven by qladder (the benchmark's peers, and
remote pools)."""
