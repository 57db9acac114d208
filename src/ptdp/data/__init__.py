"""Data pipeline: corpus files -> byte-level BPE tokenizer -> .bin/.idx token files -> windows -> DP-sharded batches.

Typical use (every rank; the preparation is cached and safe to run concurrently)::

    data = prepare_data(None, vocab_size=4096, cache_dir=Path("~/.cache/ptdp").expanduser())
    windows = TokenWindows(data.train_tokens(), seq_length)
    sampler = GlobalBatchSampler(len(windows), global_batch_size, seed)
    mine = dp_shard(sampler.global_batch(consumed_samples), dp_rank, dp_size)
    for tokens, labels in microbatches(windows, mine, micro_batch_size): ...
"""

from typing import TYPE_CHECKING

from ptdp.data.corpus import (
    Document,
    corpus_fingerprint,
    default_corpus_paths,
    iter_documents,
)
from ptdp.data.errors import DataError
from ptdp.data.indexed import IndexedTokens, token_dtype, write_indexed
from ptdp.data.prepare import prepare_data
from ptdp.data.prepared_data import PreparedData
from ptdp.data.tokenizer import (
    EOS_TOKEN,
    TokenizerModel,
    load_tokenizer,
    load_tokenizer_model,
    save_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "Document",
    "GlobalBatchSampler",
    "IndexedTokens",
    "PreparedData",
    "TokenWindows",
    "TokenizerModel",
    "corpus_fingerprint",
    "default_corpus_paths",
    "device_microbatches",
    "dp_shard",
    "eval_indices",
    "iter_documents",
    "load_tokenizer",
    "load_tokenizer_model",
    "microbatches",
    "prepare_data",
    "save_tokenizer",
    "token_dtype",
    "train_tokenizer",
    "write_indexed",
]

if TYPE_CHECKING:
    from ptdp.data.dataset import (
        GlobalBatchSampler,
        TokenWindows,
        device_microbatches,
        dp_shard,
        eval_indices,
        microbatches,
    )

#: Names of :mod:`ptdp.data.dataset` (which imports torch), imported on first use, so that the
#: processes that only tokenize (:mod:`ptdp.data.encode`) start without torch.
_DATASET_NAMES = frozenset(
    {"GlobalBatchSampler", "TokenWindows", "device_microbatches", "dp_shard", "eval_indices", "microbatches"}
)


def __getattr__(name: str):
    if name in _DATASET_NAMES:
        from ptdp.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'ptdp.data' has no attribute {name!r}")
