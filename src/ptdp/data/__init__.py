"""Data pipeline: corpus files -> byte-level BPE tokenizer -> .bin/.idx token files -> windows -> DP-sharded batches."""
