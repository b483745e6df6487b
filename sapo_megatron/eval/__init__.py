"""Evaluation suites as the papers report them: avg@n, pass@k and maj@n per dataset and per source, during
training (the ``eval`` config section) and standalone (``sapo-megatron eval``); plots of a run
(``sapo-megatron report``). See docs/evaluation.md.

- :mod:`~sapo_megatron.eval.config`: the ``eval`` section;
- :mod:`~sapo_megatron.eval.metrics`: the metrics, pure Python / NumPy;
- :mod:`~sapo_megatron.eval.inputs`: datasets, prompt encoding and rewards for evaluation (the one adapter to
  the data and reward packages);
- :mod:`~sapo_megatron.eval.runner`: generate, score, aggregate; ``eval.json`` and ``samples.jsonl``;
- the trainer's one call lives in the loop, :mod:`~sapo_megatron.loop.evaluation`;
- :mod:`~sapo_megatron.eval.cli`: the ``eval`` and ``report`` commands; :mod:`~sapo_megatron.eval.report`:
  a run's plots and ``report.md``.
"""
