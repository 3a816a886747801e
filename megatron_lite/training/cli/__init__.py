"""The command line, in one place: Megatron-LM's flags and the config fields they set.

- flags.py: the one table (flag, config section, field, type, help) for the model, parallelism, MoE,
  data, logging and profiling; a flag's help is its field's docstring unless the table says otherwise
  (field_docs.py);
- ranges.py: each numeric flag's allowed values, checked on the command line and by the config's
  validation;
- parser.py: the parser built from the table and the flags' mapping onto a validated ConfigContainer,
  with the flags that set other fields mapped by parallel_args.py, data_args.py and moe_args.py.

The tables and ranges sit beside the config (its validation names flags); the parser above the loop's
checkpoints (``--use-checkpoint-args`` reads one). ``megatron_lite.training.arguments`` is upstream's path.
"""
