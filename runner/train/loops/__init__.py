"""The loops: one per algorithm (grpo, ppo, opd, dpo), the step loop they share (loop.py), the
rollout steps (rollouts.py), the held-out evaluation (held_out.py, whose generation and scores
the eval command shares), the producer that samples ahead (pipeline.py) and the batches' layout
over ranks and minibatches (batches.py)."""
