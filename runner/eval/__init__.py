"""``posttrain-run eval``: the driver's decision of what the ranks evaluate (job.py: the typed
``EvalJob`` and the plan's roles; checkpoints.py: which checkpoint, refused when it is not the
recipe's), the program every rank runs (rank.py: build, evaluate its share of the held-out
prompts) and rank 0's result (result.py: the metrics, ``eval.json`` and the table).

This package sits above ``runner.train``: it builds the engine with the training assembly's
shared build (``runner.train.assembly.build``) and generates and scores the held-out prompts as
a run's held-out evaluation does (``runner.train.loops.held_out``, pass@k and maj@n from
``runner.rewards.passk``), which training uses too and therefore keeps below it.
"""
