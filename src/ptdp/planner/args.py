"""Flags of ``ptdp plan``; names match ``ptdp train`` (and Megatron-LM) where they overlap."""

from __future__ import annotations

import argparse

from ptdp.args import int_list
from ptdp.planner.plan import RECOMPUTE


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (a preset, optionally overridden, or the shape flags alone)")
    g.add_argument("--model", help="preset name, e.g. gpt3-175b, gpt-1.7b ... gpt-1008b, llama2-70b, llama3-8b")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden size (GPT)")
    g.add_argument("--vocab-size", type=int, help="default 51200 unless the preset says otherwise")
    g.add_argument("--seq-length", type=int, help="tokens per sample (default: the preset's, else 2048)")
    g.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    g.add_argument("--swiglu", action="store_true", help="gated MLP with three matrices (Llama)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")

    g = parser.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=False, help="number of GPUs (required unless --validate)")
    g.add_argument("--gpus-per-node", type=int, help="default: the GPU's usual node size (8)")
    g.add_argument("--gpu", default="a100-80gb", help="GPU name from the catalog (default: %(default)s)")
    g.add_argument("--gpu-catalog", metavar="FILE", help="TOML/JSON file with more GPUs (see planner/hardware.py)")
    g.add_argument("--topology", metavar="FILE",
                   help="saved `nvidia-smi topo -m` output of one node: its GPU count and link types "
                        "(NVLink or PCIe) replace the catalog's node")

    g = parser.add_argument_group("layout: any flag given fixes that choice, the others are searched")
    g.add_argument("--tensor-model-parallel-size", "--tp", type=int, metavar="TP")
    g.add_argument("--pipeline-model-parallel-size", "--pp", type=int, metavar="PP")
    g.add_argument("--data-parallel-size", "--dp", type=int, metavar="DP")
    g.add_argument("--micro-batch-size", "--mbs", type=int)
    g.add_argument("--global-batch-size", "--gbs", type=int, help="samples per step (required unless --validate)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk: interleaved 1F1B with v = layers / (pp x this)")
    g.add_argument("--pipeline-layer-split", type=int_list, metavar="N,N,...",
                   help="explicit layers per pipeline stage (uneven splits, e.g. 9,10,10,9); fixes pp, v = 1")
    g.add_argument("--virtual-pipeline-stages", type=int, help="v directly (alternative to the flag above)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE,
                   help="activation recomputation (default: search none, selective and full)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism on or off (default: search both)")
    g.add_argument("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="ZeRO-1 optimizer sharding on or off (default: search both)")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                      help="bf16 mixed precision (default for planning)")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="fp16 mixed precision")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                      help="fp32 training (default for --calibrate, like ptdp train)")
    parser.set_defaults(precision=None)

    g = parser.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="fitting layouts to list (default: %(default)s)")
    g.add_argument("--json", action="store_true", help="print the plans as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="draw memory and time breakdowns of the top layouts")
    g.add_argument("--memory-overhead-gib", type=float,
                   help="fixed memory per GPU for framework and buffers (default: the planner's)")
    g.add_argument("--validate", metavar="CSV", help="evaluate the published runs in CSV instead of searching")
    g.add_argument("--hardware-profile", metavar="FILE",
                   help="use (or, with --calibrate, write) a measured profile instead of --gpu "
                        "(default for --calibrate: $PTDP_CACHE_DIR/hardware-profile.json)")

    g = parser.add_argument_group("calibration: measure this machine for the planner")
    g.add_argument("--calibrate", action="store_true",
                   help="measure GEMM FLOP/s at the shapes of a ptdp train run, memory bandwidth and "
                        "all-reduce speed of the backend with the run's workers; write a hardware profile. "
                        "Layout and model flags not given take ptdp train's defaults")
    g.add_argument("--nproc-per-node", type=int, default=8, help="workers for --calibrate (default: %(default)s)")
    g.add_argument("--update-benchmarks", metavar="FILE",
                   help="with --validate: write the table into this markdown file (e.g. BENCHMARKS.md)")
