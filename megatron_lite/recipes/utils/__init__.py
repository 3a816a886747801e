"""Helpers the recipes share: ``optimizer_utils`` (optimizer and schedule pairs), ``tokenizer_utils``
(the NullTokenizer's default vocabulary), ``environment_utils`` (the process environment every
hardware recipe sets)."""
