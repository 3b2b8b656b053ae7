"""Benchmarks: each prints a table of ratios against a baseline measured in the same run."""
