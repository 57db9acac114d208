"""Command-line flags of ``ptdp train`` (and ``python -m ptdp.train`` under torchrun).

Flag names follow Megatron-LM (``--tensor-model-parallel-size``, ``--micro-batch-size``, ...) with
short aliases (``--tp``, ``--mbs``). Defaults come from the dataclasses in :mod:`ptdp.config`,
except the parallel sizes: ``ptdp train`` defaults to tp=2, pp=2 and dp inferred from the number
of workers (8 local workers unless told otherwise).
"""

from __future__ import annotations

import argparse

from ptdp.config import DTYPES, Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig

DEFAULT_TP, DEFAULT_PP, DEFAULT_LOCAL_WORKERS = 2, 2, 8


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_arguments(parser: argparse.ArgumentParser, *, local_launch: bool) -> None:
    """Add every training flag to ``parser``; ``local_launch`` adds ``--nproc-per-node``."""
    mc, tc, pc, dc = ModelConfig(), TrainConfig(), ParallelConfig(), DataConfig()
    g = parser.add_argument_group("parallel layout (world = tp x pp x dp; TP innermost, PP outermost)")
    g.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=DEFAULT_TP, metavar="TP",
                   help=f"tensor-parallel size: each layer's matrices split over TP ranks (default {DEFAULT_TP})")
    g.add_argument("--pipeline-model-parallel-size", "--pp", type=int, default=DEFAULT_PP, metavar="PP",
                   help=f"pipeline-parallel size: layers split into PP stages (default {DEFAULT_PP})")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=None, metavar="DP",
                   help="data-parallel size (default: world size / (TP x PP))")
    g.add_argument("--pipeline-layer-split", type=_int_list, default=None, metavar="N,N,...",
                   help="explicit layers per pipeline stage, e.g. 3,3,2 (default: even split)")
    if local_launch:
        g.add_argument("--nproc-per-node", type=int, default=None,
                       help=f"local worker processes (default: TP x PP x DP if --dp is given, else {DEFAULT_LOCAL_WORKERS} "
                       "when TP x PP divides it, else TP x PP)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=pc.distributed_timeout_minutes,
                   help="timeout of every process group (default %(default)s)")

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=mc.num_layers)
    g.add_argument("--hidden-size", type=int, default=mc.hidden_size)
    g.add_argument("--num-attention-heads", type=int, default=mc.num_attention_heads)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=mc.seq_length)
    g.add_argument("--vocab-size", type=int, default=mc.vocab_size, help="size of the BPE tokenizer to train")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=mc.make_vocab_size_divisible_by)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--params-dtype", choices=DTYPES, default=mc.params_dtype)
    g.add_argument("--init-method-std", type=float, default=mc.init_method_std)

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", "--mbs", type=int, default=tc.micro_batch_size)
    g.add_argument("--global-batch-size", "--gbs", type=int, default=tc.global_batch_size)
    g.add_argument("--train-iters", type=int, default=tc.train_iters)
    g.add_argument("--lr", type=float, default=tc.lr)
    g.add_argument("--min-lr", type=float, default=tc.min_lr)
    g.add_argument("--lr-warmup-iters", type=int, default=tc.lr_warmup_iters)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=tc.weight_decay)
    g.add_argument("--adam-beta1", type=float, default=tc.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=tc.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=tc.adam_eps)
    g.add_argument("--clip-grad", type=float, default=tc.clip_grad, help="global gradient-norm clip; 0 disables")
    g.add_argument("--seed", type=int, default=tc.seed)

    g = parser.add_argument_group("data and output")
    g.add_argument("--data", action="append", default=None, metavar="PATH",
                   help="text/jsonl file or folder; repeatable (default: the Python standard library's .py files)")
    g.add_argument("--data-cache-dir", default=dc.data_cache_dir,
                   help="where tokenizer and token files are cached (default $PTDP_CACHE_DIR or ~/.cache/ptdp)")
    g.add_argument("--valid-fraction", type=float, default=dc.valid_fraction,
                   help="fraction of documents held out for validation (default %(default)s)")
    g.add_argument("--output-dir", default=None, help="run directory (default runs/<time>-tpX-ppY-dpZ)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into an existing, non-empty --output-dir")
    g.add_argument("--log-interval", type=int, default=tc.log_interval)
    g.add_argument("--eval-interval", type=int, default=tc.eval_interval)
    g.add_argument("--eval-iters", type=int, default=tc.eval_iters)
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def config_from_args(args: argparse.Namespace) -> Config:
    """The (not yet resolved) :class:`Config` the flags describe."""
    return Config(
        model=ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            params_dtype=args.params_dtype, init_method_std=args.init_method_std,
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            data_parallel_size=args.data_parallel_size, pipeline_layer_split=args.pipeline_layer_split,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        ),
        train=TrainConfig(
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, seed=args.seed,
            log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        ),
        data=DataConfig(
            data_paths=tuple(args.data or ()), data_cache_dir=args.data_cache_dir, valid_fraction=args.valid_fraction,
        ),
        output_dir=args.output_dir,
    )


def local_world_size(args: argparse.Namespace) -> int:
    """Workers ``ptdp train`` starts on this machine."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.data_parallel_size is not None:
        return model_parallel * args.data_parallel_size
    if model_parallel > 0 and DEFAULT_LOCAL_WORKERS % model_parallel == 0:
        return DEFAULT_LOCAL_WORKERS
    return model_parallel
