"""``ptdp convert to-hf | from-hf``: a checkpoint to a Hugging Face GPT-2, Llama, Qwen3, Mixtral or
Qwen3-MoE folder, or back (:mod:`ptdp.run.checkpoint.hf`). After ``from-hf`` it prints the ``ptdp
train`` flags that continue pre-training the imported model (its shape and MoE options), with
``--tokenizer-model`` when the folder has a ``tokenizer.json`` of the model's vocabulary size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(conv: argparse.ArgumentParser) -> None:
    from ptdp.config.train_flags import HelpFormatter

    conv.formatter_class = HelpFormatter
    conv.add_argument(
        "direction",
        choices=("to-hf", "from-hf"),
        help="to-hf: ptdp checkpoint -> GPT-2 folder (Llama with RMSNorm, --swiglu and rope; Qwen3 with "
        "--qk-layernorm too; MoE models: Mixtral, or Qwen3-MoE with --qk-layernorm); "
        "from-hf: GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE folder -> ptdp checkpoint",
    )
    conv.add_argument("source", help="checkpoint root/iteration folder (to-hf) or Hugging Face folder (from-hf)")
    conv.add_argument("target", help="Hugging Face folder to write (to-hf) or checkpoint root to write (from-hf)")


def run(args: argparse.Namespace) -> int:
    from ptdp.run.checkpoint.hf import export_hf, import_hf

    if args.direction == "to-hf":
        out = export_hf(args.source, args.target)
        files = ", ".join(sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")))
        print(f"wrote {out} ({files})")
    else:
        print(f"wrote {import_hf(args.source, args.target)}; load it with --load {args.target}")
        print(continue_hint(Path(args.source), args.target))
    return 0


def continue_hint(source: Path, target: str) -> str:
    """The ``ptdp train`` command line that continues pre-training the model imported from ``source``
    into ``target``: its shape flags and, when ``source`` has a ``tokenizer.json`` whose size equals
    the model's vocabulary, ``--tokenizer-model source`` (else a note saying why not)."""
    from ptdp.data.tokenizer import load_tokenizer_model
    from ptdp.errors import DataError
    from ptdp.run.checkpoint.hf import configs_from_hf

    model, moe = configs_from_hf(json.loads((source / "config.json").read_text()))
    command = f"ptdp train --load {target} " + " ".join(model_flags(model, moe)) + " --data ..."
    if not (source / "tokenizer.json").is_file():
        return (
            f"continue pre-training: {command} (with a tokenizer of {model.vocab_size} tokens: "
            f"--tokenizer-model PATH; {source} has no tokenizer.json)"
        )
    try:
        tokenizer = load_tokenizer_model(source)
    except DataError as err:
        return f"continue pre-training: {command}; its tokenizer cannot be used: {err}"
    if tokenizer.vocab_size != model.vocab_size:
        return (
            f"continue pre-training: {command}; note: {source / 'tokenizer.json'} has {tokenizer.vocab_size} "
            f"tokens but the model's vocabulary is {model.vocab_size}: --tokenizer-model needs them equal"
        )
    return f"continue pre-training with its tokenizer: {command} --tokenizer-model {source}"


def model_flags(model, moe=None) -> list[str]:
    """``ptdp train`` flags giving the fields of ``model`` and of its MoE options ``moe`` (None: a
    dense model) that differ from the defaults (vocab_size aside: the tokenizer sets it), spelled
    as the schema defines them."""
    from ptdp.config.flags import settings

    sections = {"model": model, "moe": moe}
    flags: list[str] = []
    for s in settings():
        given = sections.get(s.section or "")
        value = getattr(given, s.name) if given is not None and s.name != "vocab_size" else s.default
        if value == s.default:
            continue
        if s.kind == "bool":
            if s.flag.negate or s.flag.name.startswith("--no-"):
                flags += [s.flag.name] if value != s.default else []
            else:
                flags += [s.flag.name if value else "--no-" + s.flag.name[2:]]
        elif value is None:
            flags += [s.flag.name, s.flag.none_choice] if s.flag.none_choice else []
        else:
            flags += [s.flag.name, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return flags
