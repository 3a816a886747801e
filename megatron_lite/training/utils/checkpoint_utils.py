"""Upstream's path (``megatron.bridge.training.utils.checkpoint_utils``) to megatron_lite.utils.checkpoint_utils:
the same module object (so a test that patches ``file_exists`` here patches what the checkpoint config
calls), its home below the config that asks it."""

import sys

from megatron_lite.utils import checkpoint_utils as _home

sys.modules[__name__] = _home
