"""Data pipeline: corpus files -> byte-level BPE tokenizer -> .bin/.idx token files -> windows -> DP-sharded batches.

Typical use (every rank; the preparation is cached and safe to run concurrently)::

    data = prepare_data(None, vocab_size=4096, cache_dir=Path("~/.cache/ptdp").expanduser())
    windows = TokenWindows(data.train_tokens(), seq_length)
    sampler = GlobalBatchSampler(len(windows), global_batch_size, seed)
    mine = dp_shard(sampler.global_batch(consumed_samples), dp_rank, dp_size)
    for tokens, labels in microbatches(windows, mine, micro_batch_size): ...
"""
