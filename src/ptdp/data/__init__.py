"""Data pipeline: corpus files -> byte-level BPE tokenizer -> .bin/.idx token files -> windows -> DP-sharded batches.

Typical use (every rank; the preparation is cached and safe to run concurrently)::

    data = prepare_data(None, vocab_size=4096, cache_dir=Path("~/.cache/ptdp").expanduser())
    windows = TokenWindows(data.train_tokens(), seq_length)
    sampler = GlobalBatchSampler(len(windows), global_batch_size, seed)
    mine = dp_shard(sampler.global_batch(consumed_samples), dp_rank, dp_size)
    for tokens, labels in microbatches(windows, mine, micro_batch_size): ...
"""

from ptdp.data.corpus import (
    Document,
    corpus_fingerprint,
    default_corpus_paths,
    iter_documents,
)
from ptdp.data.dataset import (
    GlobalBatchSampler,
    TokenWindows,
    device_microbatches,
    dp_shard,
    eval_indices,
    microbatches,
)
from ptdp.data.errors import DataError
from ptdp.data.indexed import IndexedTokens, token_dtype, write_indexed
from ptdp.data.prepare import PreparedData, prepare_data
from ptdp.data.tokenizer import EOS_TOKEN, load_tokenizer, save_tokenizer, train_tokenizer

__all__ = [
    "DataError",
    "Document",
    "EOS_TOKEN",
    "GlobalBatchSampler",
    "IndexedTokens",
    "PreparedData",
    "TokenWindows",
    "corpus_fingerprint",
    "default_corpus_paths",
    "device_microbatches",
    "dp_shard",
    "eval_indices",
    "iter_documents",
    "load_tokenizer",
    "microbatches",
    "prepare_data",
    "save_tokenizer",
    "token_dtype",
    "train_tokenizer",
    "write_indexed",
]
