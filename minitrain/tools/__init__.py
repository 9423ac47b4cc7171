"""Tooling beside training: reports, plots and models of the parts. Training never imports it."""
