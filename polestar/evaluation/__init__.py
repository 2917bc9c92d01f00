"""Evaluation with lm-evaluation-harness: the ``polestar`` lm-eval model, Table 1 presets, local task files.

Nothing here imports lm-eval until it is used: ``import polestar.evaluation.lm_eval_model`` (or
``polestar lm-eval``) registers the model; :mod:`.presets`, :mod:`.tasks`, :mod:`.loglikelihood` and
:mod:`.distributed` work without lm-eval installed.
"""
