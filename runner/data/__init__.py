"""Prompt and preference sources, ordering, sharding and the resumable data cursor."""
