"""A tokenizer "trained elsewhere", built locally without a network: unlike ptdp's own byte-level
BPE it splits on whitespace first, knows ``<unk>``, ``<s>`` and ``</s>`` (no ``<|endoftext|>``)
and adds ``<s>`` in front of every encoding by its post-processor, like Llama's tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from helpers.texts import make_texts

SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tokenizer(vocab_size: int = 300, texts: list[str] | None = None) -> Tokenizer:
    """A BPE over whitespace-split words with ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(texts if texts is not None else make_texts(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def write_tokenizer_folder(folder: Path, vocab_size: int = 300, eos_token: str | None = "</s>") -> Path:
    """``folder`` with ``tokenizer.json`` and, when ``eos_token`` is given, a ``tokenizer_config.json``
    naming it (as a downloaded model folder has)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    if eos_token is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token, "bos_token": "<s>"}))
    return folder
