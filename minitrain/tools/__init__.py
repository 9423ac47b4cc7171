"""Tooling beside training: reports, plots, models of the parts, and the benchmarks' shared code and checks.
Training never imports it."""
