"""Run modes: what a job does (train; or plan, preflight and dry-run it first), built on the loop below them.

- preflight.py: will the job fit, before a GPU hour is spent (``--memory-preflight``): each stage's
  predicted peak (training/memory/predict), the verdict and the cheapest fix (training/memory/levers);
- train.py: training itself, one worker's body for a validated config (pretrain.py's and the recipe
  runner's workers);
- plan/: which layout to run (``python -m megatron_lite.plan``): every layout the validation accepts,
  predicted, ranked by what can be stated honestly, the best confirmed by the dry run;
- dry_run/: each stage's real code (the loop's set-up and train_step) at full size on fake tensors in a
  fake world, measured by the allocated-bytes tracker (``--memory-dry-run``).

This package imports down into training/ and training/memory/; nothing below imports it.
"""
