"""``python -m megatron_lite.plan --recipe NAME --gpus N --device-memory-gb G`` (run_modes/plan/cli.py)."""

import sys

from megatron_lite.run_modes.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
