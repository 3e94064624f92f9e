"""Capture: the model's serial dataflow graph at the aten level, and the passes that normalise it."""
