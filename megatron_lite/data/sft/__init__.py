"""Supervised fine-tuning data (Megatron-LM's ``--sft``, Megatron-Bridge's ``GPTSFTDataset`` /
``GPTSFTPackedDataset``): conversations or prompt / answer pairs read from JSONL, rendered, tokenized,
masked so that only the answers are learned, and packed into rows that carry each example's
boundaries (``cu_seqlens``) and restarted position ids.

``examples`` reads and validates the JSONL, ``prompt`` renders and tokenizes one example, ``packing``
bins examples and builds the rows, ``packed_file`` is the offline packs' file format (safetensors),
``dataset`` the datasets, ``config`` the dataset section ``--sft`` builds.
"""
