"""Verification: the serial oracle, per-op validation, the whole-model check and the sweep."""
