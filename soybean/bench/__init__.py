"""Benchmarks (tooling, outside the compiler core): the training-step harness and its statistics.

* :mod:`.harness` -- ``soybean bench``: serial, DDP, torch TP, FSDP2 and soybean's plans, one spawn.
* :mod:`.stats` -- paired sign-test intervals, verdicts and rank correlation.
"""
