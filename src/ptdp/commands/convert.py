"""``ptdp convert to-hf | from-hf``: a checkpoint to a Hugging Face GPT-2 or Llama folder, or back
(:mod:`ptdp.run.checkpoint.hf`)."""

from __future__ import annotations

import argparse


def add_arguments(conv: argparse.ArgumentParser) -> None:
    from ptdp.commands.train_flags import HelpFormatter

    conv.formatter_class = HelpFormatter
    conv.add_argument("direction", choices=("to-hf", "from-hf"),
                      help="to-hf: ptdp checkpoint -> GPT-2 folder (Llama with RMSNorm, --swiglu and rope); "
                           "from-hf: GPT-2 or Llama folder -> ptdp checkpoint")
    conv.add_argument("source", help="checkpoint root/iteration folder (to-hf) or GPT-2/Llama folder (from-hf)")
    conv.add_argument("target", help="GPT-2/Llama folder to write (to-hf) or checkpoint root to write (from-hf)")


def run(args: argparse.Namespace) -> int:
    from ptdp.run.checkpoint.hf import export_hf, import_hf

    if args.direction == "to-hf":
        print(f"wrote {export_hf(args.source, args.target)} (config.json, model.safetensors)")
    else:
        print(f"wrote {import_hf(args.source, args.target)}; load it with --load {args.target}")
    return 0
