"""Flags of ``ptdp plan``. The flags it shares with ``ptdp train`` (model shape, layout, batch,
recompute, sequence parallelism, distributed optimizer, precision) are generated from the same
schema fields (:mod:`ptdp.config.flags`): the same names, aliases, types and choices; here each
defaults to None, meaning "take the preset's value" (model) or "search this choice" (layout).
"""

from __future__ import annotations

import argparse

from ptdp.config.flags import add_flags
from ptdp.errors import ConfigError
from ptdp.planner.candidate import PRECISION_OF_DTYPE
from ptdp.planner.inputs.hardware import CATALOG

#: --cp-implementation's choices (:attr:`ptdp.planner.time.constants.PerfConstants.cp_implementation`)
CP_IMPLEMENTATIONS = ("te", "torch")
#: ptdp train's --params-dtype as the planner's precision (float64 is not planned; auto is what
#: ptdp train picks on GPUs, which the planner plans for)
PRECISION = {"auto": "bf16", **PRECISION_OF_DTYPE}


def plan_precision(args: argparse.Namespace) -> str | None:
    """The planner's precision for ``--params-dtype`` / ``--bf16`` / ``--fp16`` / ``--fp32`` (None
    when not given); ConfigError for float64, which the planner does not model."""
    dtype = getattr(args, "params_dtype", None)
    if dtype is None:
        return None
    if dtype not in PRECISION:
        raise ConfigError(
            f"--params-dtype {dtype}: the planner models bfloat16, float16 and float32 training "
            f"(--bf16, --fp16, --fp32)"
        )
    return PRECISION[dtype]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``ptdp plan`` on ``parser``, in the order ``--help`` lists them: the model
    (with the flags shared with ``ptdp train``, generated from the schema), the cluster, the output
    and the calibration."""
    _add_model_arguments(parser)
    add_flags(parser, "plan")  # shared with ptdp train: the model shape, layout, batch and options
    _add_overlap_arguments(parser)
    _add_layout_argument(parser)
    _add_graph_arguments(parser)
    _add_cluster_arguments(parser)
    _add_output_arguments(parser)
    _add_calibration_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (a preset, optionally overridden, or the shape flags alone)")
    g.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="preset name, e.g. gpt3-175b, gpt-1.7b ... gpt-1008b, llama2-70b, llama3-8b/70b/405b, "
        "nemotron4-340b; mixture of experts: mixtral-8x7b/8x22b, qwen2-57b-a14b, qwen3-30b-a3b, "
        "qwen3-235b-a22b, gpt-oss-20b/120b, deepseek-v3, kimi-k2; or a Hugging Face config.json (the file, or a "
        "folder holding it) of a Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE, "
        "DeepSeek-V3 or gpt-oss model; --seq-length default: its max_position_embeddings",
    )
    g.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="multi-token-prediction modules trained beside the model (Megatron-Core's flag; planner "
        "only; default: the preset's, deepseek-v3 1): each a layer on the last stage, a [h, 2h] "
        "projection and the output layer and loss once more",
    )
    g.add_argument(
        "--moe-load-imbalance",
        type=float,
        default=None,
        metavar="RHO",
        help="tokens the busiest expert rank receives over the balanced share (planner only; >= 1, "
        "default 1.0: balanced, as NVIDIA's published runs force it): scales the experts' compute, "
        "activations and all-to-all receive, at most the capacity factor when one is given",
    )
    g.add_argument(
        "--recompute-modules",
        nargs="+",
        metavar="MODULE",
        default=None,
        help="with --recompute-granularity selective: what Megatron-Core recomputes (its flag; "
        "planner only): core_attn (the default: the attention core), layernorm (the norms' outputs "
        "feeding QKV and fc1), mlp (the whole MLP but its input); of MoE and MLA models moe_act (the "
        "experts' activation), moe (the whole MoE MLP, its all-to-alls included), shared_experts, "
        "mla_up_proj (MLA's up projections)",
    )
    g.add_argument(
        "--selective-ac-option",
        choices=("op",),
        default=None,
        help="with --recompute-granularity selective: plan torchtitan's per-op selective activation "
        'checkpointing (its selective_ac_option = "op"; planner only): each layer keeps its input, '
        "the attention output and every second matmul output, and backward runs the other matmuls "
        "and the memory-bound kernels again",
    )
    g.add_argument(
        "--fp8-param-gather",
        action="store_true",
        default=None,
        help="with --fp8-format: keep the FP8 GEMMs' weights in FP8 (Megatron-LM's flag; Transformer "
        "Engine's FP8 parameters): 1 byte each and no FP8 copy (planner only; planned as Transformer "
        "Engine's FP8, delayed scaling)",
    )
    g.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        default=None,
        help="plan Megatron-Core's precision-aware optimizer (its flag; planner only): the "
        "optimizer state in the dtypes below, with 16-bit parameters",
    )
    for flag, choices, what in (
        ("--main-params-dtype", ("fp32", "fp16"), "main parameters"),
        ("--exp-avg-dtype", ("fp32", "fp16", "bf16", "fp8"), "Adam's first moment"),
        ("--exp-avg-sq-dtype", ("fp32", "fp16", "bf16", "fp8"), "Adam's second moment"),
    ):
        g.add_argument(
            flag,
            choices=choices,
            default=None,
            help=f"with --use-precision-aware-optimizer: the dtype of the {what} (Megatron-Core's flag; default fp32)",
        )


def _add_overlap_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "communication overlap the run uses (planner only: ptdp train overlaps the data-parallel "
        "reduction, --overlap-grad-reduce, and neither of these)"
    )
    g.add_argument(
        "--tp-comm-overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan Transformer Engine's tensor-parallel comm-GEMM overlap (Megatron's flag): with "
        "sequence parallelism, (tp - 1) / tp of the layers' tensor-parallel communication hidden "
        "behind their GEMMs; default: off",
    )
    g.add_argument(
        "--enable-async-tensor-parallel",
        "--async-tp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan PyTorch's asynchronous tensor parallelism instead (torchtitan's "
        "enable_async_tensor_parallel, with torch.compile): with sequence parallelism, (tp - 1) / tp "
        "of the forward pass's tensor-parallel communication hidden, none of backward's or of a "
        "recomputed forward's; default: off",
    )
    g.add_argument(
        "--overlap-p2p-communication",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan the interleaved schedule's pipeline transfers overlapped with the next model "
        "chunk's compute (Megatron's default, --no-overlap-p2p-communication there turns it off); "
        "the fill and drain transfers stay exposed; default: off, as ptdp's runtime waits for them",
    )
    g.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan the MoE layers' all-to-alls behind another micro-batch's compute (Megatron-Core's "
        "flag, with --delay-wgrad-compute there); default: off, as ptdp train runs them in line",
    )
    g.add_argument(
        "--delay-wgrad-compute",
        action="store_true",
        default=None,
        help="Megatron-Core's companion of --overlap-moe-expert-parallel-comm (the weight gradients "
        "computed after the overlapped exchanges), which needs it: planned as part of that overlap",
    )
    g.add_argument(
        "--moe-flex-dispatcher-backend",
        choices=("deepep", "hybridep"),
        default=None,
        help="plan Megatron-Core's flex token dispatcher (--moe-token-dispatcher-type flex) with this "
        "backend (planner only; flex alone: deepep): each token crosses the network once per other "
        "node holding one of its experts and reaches each GPU holding one once; default: the plain "
        "all-to-all of --moe-token-dispatcher-type alltoall",
    )
    g.add_argument(
        "--cp-implementation",
        choices=CP_IMPLEMENTATIONS,
        default=None,
        help="the context-parallel implementation the run uses (planner only): te, Transformer "
        "Engine's (Megatron-Core's), merges each ring step's output and accumulates the gradients "
        "in fused kernels, not counted; torch, PyTorch's experimental context_parallel "
        "(torchtitan's), does it with out-of-place float32 tensor ops whose memory traffic is "
        "added (planner/time/cp_exchange.py); default: te",
    )


#: Megatron-Core's ``--cuda-graph-impl`` and ``--cuda-graph-scope`` values
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def _add_layout_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline-model-parallel-layout",
        metavar="LAYOUT",
        default=None,
        help="Megatron-Core's layout string (planner only; E the embedding, t a layer, m an MTP module, "
        "L the loss, | between the pp x v model chunks, X*N and (...)*N repeat; needs "
        "--pipeline-model-parallel-size): planned as v, the embedding and loss counted as layers, or at "
        "v = 1 the split, as `ptdp plan` prints it for MTP models; uneven interleaved chunks as the "
        "nearest even layout, with a note",
    )


def _add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CUDA graphs the run uses (planner only: ptdp train launches its kernels eagerly)")
    g.add_argument(
        "--cuda-graph-impl",
        choices=CUDA_GRAPH_IMPLS,
        default=None,
        help="plan the run's CUDA graphs (Megatron-Core's flag and rules: no full recompute; local "
        "captures whole layers or, with --cuda-graph-scope full_iteration, the iteration): where they "
        "hold the MoE layers' router (scopes moe_router, moe, full_iteration, or local's whole "
        "layers) the layers' fixed per-layer cost, the launches of many small kernels, is not paid; "
        "default: none",
    )
    g.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        default=None,
        help="Megatron-Core's older spelling of --cuda-graph-impl local",
    )
    g.add_argument(
        "--external-cuda-graph",
        action="store_true",
        default=None,
        help="Megatron-Core's older spelling of --cuda-graph-impl transformer_engine",
    )
    g.add_argument(
        "--cuda-graph-scope",
        nargs="+",
        choices=CUDA_GRAPH_SCOPES,
        default=None,
        metavar="SCOPE",
        help=f"what the graphs capture (Megatron-Core's flag; {', '.join(CUDA_GRAPH_SCOPES)}); needs "
        "--cuda-graph-impl; default: local's whole layers, transformer_engine's attn with mlp and/or "
        "moe (the layers the model has)",
    )


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=False, help="number of GPUs (required unless --validate)")
    g.add_argument("--gpus-per-node", type=int, help="default: the GPU's usual node size (8)")
    g.add_argument(
        "--gpu",
        default="a100-80gb",
        help=f"GPU name from the catalog: {', '.join(sorted(CATALOG))} (default: %(default)s)",
    )
    g.add_argument(
        "--gpu-catalog", metavar="FILE", help="TOML/JSON file with more GPUs (see planner/inputs/hardware.py)"
    )
    g.add_argument(
        "--gpu-power-limit",
        metavar="WATTS",
        type=float,
        help="the board power limit the GPUs run at (nvidia-smi -pl): their tensor-core peaks "
        "interpolated in watts between the catalog's ratings of the chip (H100: 835 TFLOP/s BF16 "
        "at 400 W, NVL; 989.5 at 700 W, SXM); default: the catalog's (h100-96gb: 500 W, the others "
        "their datasheet rating)",
    )
    g.add_argument(
        "--topology",
        metavar="FILE",
        help="saved `nvidia-smi topo -m` output of one node: its GPU count and link types "
        "(NVLink or PCIe) replace the catalog's node",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="fitting layouts to list (default: %(default)s)")
    g.add_argument("--json", action="store_true", help="print the plans as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="draw memory and time breakdowns of the top layouts")
    g.add_argument(
        "--memory-overhead-gib",
        type=float,
        help="memory per GPU outside the tensors (CUDA context, cuBLAS workspaces, NCCL buffers); "
        "default: the planner's estimate for the layout (about 1 GiB; planner/memory/overhead.py)",
    )
    g.add_argument(
        "--validate",
        metavar="CSV",
        nargs="+",
        help="evaluate the published runs in these tables instead of searching: each run at its "
        "layout, in-sample and with the fit leaving its source out (over all tables given), and "
        "its memory against its GPU's",
    )
    g.add_argument(
        "--hardware-profile",
        metavar="FILE",
        help="use (or, with --calibrate, write) a measured profile instead of --gpu "
        "(default for --calibrate: $PTDP_CACHE_DIR/hardware-profile.json)",
    )


def _add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("calibration: measure this machine for the planner")
    g.add_argument(
        "--calibrate",
        action="store_true",
        help="measure GEMM FLOP/s at the shapes of a ptdp train run, memory bandwidth and "
        "all-reduce speed of the backend with the run's workers; write a hardware profile. "
        "Layout and model flags not given take ptdp train's defaults",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="workers for --calibrate, one per GPU (default: the visible GPUs, else 8)",
    )
    g.add_argument(
        "--update-benchmarks",
        metavar="FILE",
        help="with --validate: write the table into this markdown file (e.g. BENCHMARKS.md)",
    )
