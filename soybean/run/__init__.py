"""Execution: the module classes that run a plan's per-rank program in a training loop."""
