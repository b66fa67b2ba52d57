"""Checkpoints (atomic, pickle-free) and resume."""
