"""Tests of the performance-regression tooling in benchmarks/."""
