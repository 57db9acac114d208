"""Command-line flags of ``ptdp train`` (and ``python -m ptdp.train`` under torchrun).

Flag names follow Megatron-LM (``--tensor-model-parallel-size``, ``--micro-batch-size``, ...) with
short aliases (``--tp``, ``--mbs``). Defaults come from the dataclasses in :mod:`ptdp.config`,
except the parallel sizes: ``ptdp train`` defaults to tp=2, pp=2 and dp inferred from the number
of workers (8 local workers unless told otherwise).
"""

from __future__ import annotations

import argparse
import difflib

import torch

from ptdp.config import (ACTIVATIONS, BIND_POLICIES, DTYPES, GRAD_COMPRESSIONS, NORMALIZATIONS, POSITION_EMBEDDINGS,
                         RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, SCHEDULES, CheckpointConfig, Config, ConfigError,
                         DataConfig, ModelConfig, ParallelConfig, TrainConfig)

DEFAULT_TP, DEFAULT_PP, DEFAULT_LOCAL_WORKERS = 2, 2, 8
#: ``ptdp train``'s process-group timeout on a machine without CUDA: local CPU workers keep each
#: other waiting for seconds at most, so a stopped worker is reported soon
LOCAL_CPU_TIMEOUT_MINUTES = 2.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and shows each flag's default value, unless the help
    text already explains it or there is none (switches, optional values)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def reject_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 through ``parser`` (its own usage) naming the unrecognized arguments ``extra`` and, for
    each unknown flag, the closest flags ``parser`` knows."""
    known = [opt for action in parser._actions for opt in action.option_strings]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-") and flag not in known:
            close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    parser.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` whose unknown flags get the closest known ones (:func:`reject_unknown`)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        reject_unknown(parser, extra)
    return args


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_arguments(parser: argparse.ArgumentParser, *, local_launch: bool) -> None:
    """Add every training flag to ``parser``; ``local_launch`` adds ``--nproc-per-node``."""
    mc, tc, pc, dc = ModelConfig(), TrainConfig(), ParallelConfig(), DataConfig()
    g = parser.add_argument_group("parallel layout (world = tp x pp x dp; TP innermost, PP outermost)")
    g.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=DEFAULT_TP, metavar="TP",
                   help=f"tensor-parallel size: each layer's matrices split over TP ranks")
    g.add_argument("--pipeline-model-parallel-size", "--pp", type=int, default=DEFAULT_PP, metavar="PP",
                   help=f"pipeline-parallel size: layers split into PP stages")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=None, metavar="DP",
                   help="data-parallel size (default: world size / (TP x PP))")
    g.add_argument("--pipeline-layer-split", type=int_list, default=None, metavar="N,N,...",
                   help="explicit layers per pipeline stage, e.g. 3,3,2 (default: even split)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default: 1f1b, or interleaved-1f1b when "
                        "--num-layers-per-virtual-pipeline-stage is given)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None, metavar="N",
                   help="layers per model chunk for the interleaved schedule: each rank holds "
                        "num_layers / (PP x N) chunks")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the activations outside the tensor-parallel regions (norms, residual adds, embedding "
                        "output) along the sequence over TP: all-gather/reduce-scatter instead of all-reduce, 1/TP "
                        "of their memory; needs TP > 1 and seq_length %% TP == 0")
    if local_launch:
        g.add_argument("--nproc-per-node", type=int, default=None,
                       help=f"local worker processes (default: TP x PP x DP if --dp is given, else {DEFAULT_LOCAL_WORKERS} "
                       "when TP x PP divides it, else TP x PP)")
        g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="when a worker dies, restart all workers up to N times; a restarted job resumes "
                            "from the newest checkpoint in --save (else --load, else from scratch)")
    local_cpu = local_launch and not torch.cuda.is_available()
    g.add_argument("--distributed-timeout-minutes", type=float, metavar="MINUTES",
                   default=LOCAL_CPU_TIMEOUT_MINUTES if local_cpu else pc.distributed_timeout_minutes,
                   help="timeout of every process group (fractions allowed): a worker that waits longer for "
                        "another fails the job, naming the rank, phase and iteration (default: "
                        f"{LOCAL_CPU_TIMEOUT_MINUTES:g} for ptdp train without CUDA, else "
                        f"{pc.distributed_timeout_minutes:g})")
    g.add_argument("--force", action="store_true",
                   help="start even when the planner's memory estimate says the run does not fit in memory")
    g.add_argument("--bind-cpus", choices=BIND_POLICIES, default=pc.bind_cpus,
                   help="bind each worker to CPUs at start-up: numa = the allowed CPUs of its GPU's NUMA node "
                        "(no GPU: workers spread over the nodes), exclusive = a non-overlapping share of them; "
                        "threads follow the CPUs bound")

    g = parser.add_argument_group("data-parallel gradient reduction and optimizer")
    g.add_argument("--ddp-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="most gradient elements per bucket (default: 40,000,000)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket's data-parallel reduction during the last microbatch's backward")
    g.add_argument("--grad-compression", choices=GRAD_COMPRESSIONS, default=pc.grad_compression,
                   help="reduce gradients over dp in fp32 (none), 16 bits, or 1 bit with error feedback")
    g.add_argument("--grad-compression-warmup-iters", type=int, default=None, metavar="N",
                   help="reduce the first N iterations exactly before compressing (default: --lr-warmup-iters "
                        "for 1bit, 0 for fp16/bf16)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard Adam's state and fp32 main parameters over dp (ZeRO-1): reduce-scatter "
                        "gradients, all-gather parameters")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: overlap the parameter all-gather with the next "
                        "forward (each module waits for its own parameters)")

    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save checkpoints into DIR (DIR/iter_NNNNNNN, DIR/latest) after the last iteration")
    g.add_argument("--save-interval", type=int, default=None, metavar="N", help="also save every N iterations")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from the checkpoint DIR/latest names (or an iteration folder), at any layout")
    g.add_argument("--keep-last", type=int, default=None, metavar="K", help="keep only the newest K checkpoints")
    g.add_argument("--no-load-optim", action="store_true", help="with --load: parameters only, fresh Adam state")
    g.add_argument("--no-load-rng", action="store_true", help="with --load: do not restore random generators")

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=mc.num_layers, help="transformer layers l (all stages)")
    g.add_argument("--hidden-size", type=int, default=mc.hidden_size, help="hidden size h")
    g.add_argument("--num-attention-heads", type=int, default=mc.num_attention_heads, help="attention heads a")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=mc.seq_length, help="tokens per sample s")
    g.add_argument("--vocab-size", type=int, default=mc.vocab_size, help="size of the BPE tokenizer to train")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=mc.make_vocab_size_divisible_by,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--activation", choices=ACTIVATIONS, default=mc.activation,
                   help="MLP activation: exact GELU or its tanh approximation (GPT-2)")
    g.add_argument("--layernorm-epsilon", type=float, default=mc.layernorm_epsilon,
                   help="epsilon of the norms (LayerNorm or RMSNorm)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="give the output layer its own weight (default: tied to the input embedding)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default=mc.normalization,
                   help="LayerNorm (weight, bias) or RMSNorm (weight only)")
    g.add_argument("--swiglu", action="store_true",
                   help="gated MLP: fc1 makes gate and up halves, each --ffn-hidden-size wide; fc2(silu(gate) * up)")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default=mc.position_embedding_type,
                   help="learned position table, or rotary embeddings of q and k (rope, no table)")
    g.add_argument("--rotary-base", type=float, default=mc.rotary_base, help="base of the rotary frequencies")
    g.add_argument("--num-query-groups", type=int, default=None, metavar="G",
                   help="grouped-query attention: G key/value heads, each shared by heads / G query heads; "
                        "needs heads %% G == 0 and G %% TP == 0 (default: multi-head attention)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the linear layers (QKV, attention output, fc1, fc2)")
    g.add_argument("--params-dtype", choices=DTYPES, default=mc.params_dtype,
                   help="parameter/activation dtype; bfloat16 and float16 keep float32 main parameters and "
                        "gradients, float16 with dynamic loss scaling")
    g.add_argument("--bf16", dest="params_dtype", action="store_const", const="bfloat16",
                   help="same as --params-dtype bfloat16")
    g.add_argument("--fp16", dest="params_dtype", action="store_const", const="float16",
                   help="same as --params-dtype float16")
    g.add_argument("--init-method-std", type=float, default=mc.init_method_std, help="std of the normal weight init")
    g.add_argument("--hidden-dropout", type=float, default=mc.hidden_dropout, metavar="P",
                   help="dropout probability of the hidden states after the embeddings, the attention projection "
                        "and fc2 (default 0: none)")
    g.add_argument("--attention-dropout", type=float, default=mc.attention_dropout, metavar="P",
                   help="dropout probability of the attention probabilities (computed without the fused kernel "
                        "when > 0; default 0: none)")

    g = parser.add_argument_group("activation recomputation (same results, less activation memory, more compute)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="full: keep only the inputs of groups of layers and run the groups again in backward; "
                        "selective: run only the attention core (scores, softmax, context) again "
                        "(default: keep every activation)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="with full: uniform = every layer, in groups of --recompute-num-layers; block = only the "
                        "first --recompute-num-layers layers of each model chunk (default with full: uniform)")
    g.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                   help="with full: layers per group (uniform, default 1) or recomputed layers per model chunk "
                        "(block, required)")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", "--mbs", type=int, default=tc.micro_batch_size, help="samples b per microbatch")
    g.add_argument("--global-batch-size", "--gbs", type=int, default=tc.global_batch_size,
                   help="samples B per optimizer step, all dp replicas together")
    g.add_argument("--train-iters", type=int, default=tc.train_iters, help="optimizer steps")
    g.add_argument("--lr", type=float, default=tc.lr, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr", type=float, default=tc.min_lr, help="learning rate at the end of the cosine decay")
    g.add_argument("--lr-warmup-iters", type=int, default=tc.lr_warmup_iters, help="linear warmup steps")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=tc.weight_decay, help="decoupled weight decay on weights and embeddings")
    g.add_argument("--adam-beta1", type=float, default=tc.adam_beta1, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=tc.adam_beta2, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=tc.adam_eps, help="AdamW epsilon")
    g.add_argument("--clip-grad", type=float, default=tc.clip_grad, help="global gradient-norm clip; 0 disables")
    g.add_argument("--max-skipped-steps", type=int, default=tc.max_skipped_steps, metavar="N",
                   help="a step with a nan/inf loss or gradient norm on any rank is skipped (no update); stop "
                        "when more than N such steps come in a row (0: at the first)")
    g.add_argument("--seed", type=int, default=tc.seed, help="seed of weight init and data order")

    g = parser.add_argument_group("data and output")
    g.add_argument("--data", action="append", default=None, metavar="PATH",
                   help="text/jsonl file or folder; repeatable (default: the Python standard library's .py files)")
    g.add_argument("--data-cache-dir", default=dc.data_cache_dir,
                   help="where tokenizer and token files are cached (default $PTDP_CACHE_DIR or ~/.cache/ptdp)")
    g.add_argument("--valid-fraction", type=float, default=dc.valid_fraction,
                   help="fraction of documents held out for validation")
    g.add_argument("--output-dir", default=None, help="run directory (default runs/<time>-tpX-ppY-dpZ)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into an existing, non-empty --output-dir")
    g.add_argument("--log-interval", type=int, default=tc.log_interval, help="write a metrics.jsonl line every N steps")
    g.add_argument("--eval-interval", type=int, default=tc.eval_interval, help="evaluate validation loss every N steps")
    g.add_argument("--eval-iters", type=int, default=tc.eval_iters, help="global batches per evaluation; 0 disables")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")
    g.add_argument("--trace", action="store_true",
                   help="record every rank's forward/backward/send/receive/wait times into trace.json "
                        "(Chrome trace, open in Perfetto) and timeline.png, and the bubble per rank in the summary")
    g.add_argument("--trace-iters", type=int, default=3, help="iterations traced with --trace, from the second on")
    g.add_argument("--hardware-profile", metavar="FILE",
                   help="profile from `ptdp plan --calibrate` for the planner's step-time prediction "
                        "(default: $PTDP_CACHE_DIR/hardware-profile.json if it exists)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The (not yet resolved) :class:`Config` the flags describe."""
    return Config(
        model=ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            activation=args.activation, layernorm_epsilon=args.layernorm_epsilon,
            params_dtype=args.params_dtype, init_method_std=args.init_method_std,
            recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
            normalization=args.normalization, swiglu=args.swiglu, position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base, num_query_groups=args.num_query_groups, add_bias_linear=args.add_bias_linear,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            data_parallel_size=args.data_parallel_size, pipeline_layer_split=args.pipeline_layer_split,
            pipeline_schedule=args.pipeline_schedule,
            num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
            sequence_parallel=args.sequence_parallel,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            ddp_bucket_size=args.ddp_bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
            grad_compression=args.grad_compression,
            grad_compression_warmup_iters=args.grad_compression_warmup_iters,
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather, bind_cpus=args.bind_cpus,
        ),
        train=TrainConfig(
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, seed=args.seed,
            max_skipped_steps=args.max_skipped_steps,
            log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
            trace_iters=args.trace_iters if args.trace else 0,
        ),
        data=DataConfig(
            data_paths=tuple(args.data or ()), data_cache_dir=args.data_cache_dir, valid_fraction=args.valid_fraction,
        ),
        checkpoint=CheckpointConfig(
            save=args.save, save_interval=args.save_interval, load=args.load, keep_last=args.keep_last,
            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
        ),
        output_dir=args.output_dir,
        hardware_profile=args.hardware_profile,
    )


def local_world_size(args: argparse.Namespace) -> int:
    """Workers ``ptdp train`` starts on this machine; ConfigError unless ``--nproc-per-node`` is a
    positive integer."""
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise ConfigError(f"nproc_per_node={args.nproc_per_node} must be a positive integer (local worker "
                              f"processes; default: tp x pp x dp)")
        return args.nproc_per_node
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.data_parallel_size is not None:
        return model_parallel * args.data_parallel_size
    if model_parallel > 0 and DEFAULT_LOCAL_WORKERS % model_parallel == 0:
        return DEFAULT_LOCAL_WORKERS
    return model_parallel


def max_restarts(args: argparse.Namespace) -> int:
    """``--max-restarts`` of ``ptdp train``; raises ConfigError unless it is >= 0."""
    if not isinstance(args.max_restarts, int) or args.max_restarts < 0:
        raise ConfigError(f"max_restarts={args.max_restarts!r} must be >= 0 (0: a failed worker ends the run)")
    return args.max_restarts
