"""The loops: one per algorithm (grpo, ppo, opd, dpo), the step loop they share (loop.py), the
rollout steps (rollouts.py), the producer that samples ahead (pipeline.py), the batches' layout
over ranks and minibatches (batches.py), and the eval rank program (eval_run.py)."""
