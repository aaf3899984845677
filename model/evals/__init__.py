"""Evaluation: downstream tasks read and scored by the model being trained, and the harness.

  tasks     task files (lm-evaluation-harness-style JSONL) -> packed scoring rows; pure Python/numpy
  evaluate  the held-out loss and the tasks' scores in the loop (LoopEvals, TaskEvaluator, Scorer)
  harness   the lm-evaluation-harness model "jaxpt" over our checkpoints (scripts/run_lm_eval.py)
"""
