"""posttrain-runner: a declarative LLM post-training runner.

One TOML recipe describes a run; ``posttrain-run recipe.toml`` runs it.
"""

__version__ = "0.1.0"
