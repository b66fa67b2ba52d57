"""A module whose import fails (used to test load_callable's error)."""

raise ValueError("broken at import time")
