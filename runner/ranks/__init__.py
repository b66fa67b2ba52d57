"""What a rank knows of its world, whatever started it: ``context.RankContext`` (which rank of
how many) and ``collective.Collective`` (sums, gathers and barriers between the ranks). Below
``runner.train``; only ``runner.launch`` knows about processes."""
