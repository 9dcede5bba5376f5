"""Benchmark apps. Each measures its variants side by side in one run and saves results
(JSON and a table, with the resolved config and library versions) under benchmarks/results/."""
