"""Benchmarks: figures as medians and ratios against a baseline measured in the same run."""
