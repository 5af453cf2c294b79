"""Training, runs and comparison: ``mrtpo train`` and ``mrtpo compare``.

- ``trainer``: the training loop (``Trainer``, ``train``), with ``run_setup`` (a run's
  model, data and resumption), ``step_advantages`` (a step's advantages) and
  ``policy_update`` (the PPO update); ``rollouts``: sampling and scoring; ``metrics``: a
  step's row; ``heldout``: the held-out evaluation;
- ``config``: every setting of a run and a comparison; ``config_fields``: the settings'
  metadata system and value checks; ``method_options``: MRTPO's own options, shared with the
  framework adapters; ``cli_args``: the command-line flags built from the fields;
- ``checkpoint``: the run folder that survives a kill;
- ``compare``: ``run_compare``, every algorithm with every seed; ``stats``: its statistics;
- ``report``, ``run_report``, ``compare_report``: a run's and a comparison's outputs.
"""
