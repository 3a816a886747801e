"""Run modes: what pretrain.py does instead of (or around) training, built on the loop below them.

- preflight.py: will the job fit, before a GPU hour is spent (``--memory-preflight``): each stage's
  predicted peak (training/memory/predict), the verdict and the cheapest fix (training/memory/levers);
- dry_run/: each stage's real code (the loop's set-up and train_step) at full size on fake tensors in a
  fake world, measured by the allocated-bytes tracker (``--memory-dry-run``).

This package imports down into training/ and training/memory/; nothing below imports it.
"""
