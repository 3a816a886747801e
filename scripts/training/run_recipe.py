#!/usr/bin/env python
"""Train a recipe (Megatron-Bridge's ``scripts/training/run_recipe.py``).

    python scripts/training/run_recipe.py --recipe gpt2_small_pretrain_cpu_config -ms 20
    python scripts/training/run_recipe.py --recipe llama3_8b_pretrain_config --dry-run -tp 2 model.num_layers=4
    torchrun --nproc-per-node 8 scripts/training/run_recipe.py --recipe llama3_70b_pretrain_config

The logic is megatron_lite.recipes.runner; see docs/recipes.md.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from megatron_lite.recipes.runner import main

    code = main(sys.argv[1:], __file__)
    if "RANK" in os.environ:  # a worker: leave without interpreter teardown, as pretrain.py's do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
