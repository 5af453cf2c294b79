"""mrtpo: a thin MRTPO training loop on Hugging Face transformers, built on mrtpo_kernels.

Uses only the public API of mrtpo_kernels. The package is grouped by concern, in wings:

- ``mrtpo.replay``: the contrastive replay and its prompt handling (the entry points
  ``replay_relevance`` and ``contrastive_replay``, the engine, which pairs are replayed,
  teacher forcing, chat templating and spans, the ``--relevance`` modes);
- ``mrtpo.model``: models and their caches (``load_model``, model access, the built-in
  models' registry and conversion, saved folders, the initial model and its warm start);
- ``mrtpo.training``: training, runs and comparison (the trainer, its settings and flags,
  rollouts, metrics, held-out evaluation, the run folder, ``mrtpo compare`` and its
  statistics and reports);
- ``mrtpo.tasks``: the built-in tasks and their offline data;
- ``mrtpo.verifiers``: the rewards of the three task families and the spans they check;
- ``mrtpo.allocation``: the allocation decisions (relevance form, stop and truncated credit);
- ``mrtpo.integrations``: the TRL, verl and OpenRLHF adapters.

``mrtpo.cli`` is the ``mrtpo`` command (``python -m mrtpo``), ``mrtpo.demo`` its CPU demo.
``mrtpo.config``, ``mrtpo.trainer``, ``mrtpo.compare``, ``mrtpo.builtin_models`` and
``mrtpo.initial_model`` are aliases of the import paths documented before the wings.
"""

__version__ = "0.1.0"
