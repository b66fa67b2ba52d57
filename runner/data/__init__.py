"""Prompt and preference sources, ordering, sharding and the resumable data cursor.

- ``sources``: ``build_prompt_source`` / ``build_prompt_sources`` -> ``PromptSource`` (GRPO, PPO,
  OPD)
- ``preference``: ``DatasetPreferenceEnv`` (DPO), over the pair sources of ``pairs``
- ``order``: ``epoch_order`` and ``shard``; ``cursor``: ``DataCursor``, ``PromptStream``,
  ``check_resume``
- ``membership``: ``check_overlap``; ``preview``: ``describe_data`` for ``--dry-run``
- ``columns``, ``contract``, ``files``: column mapping, the factory contract, file and hub reading
- ``arithmetic``: the built-in task
"""
