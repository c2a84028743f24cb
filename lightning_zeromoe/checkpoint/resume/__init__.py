"""Resuming a checkpoint, on the same or another shape."""
