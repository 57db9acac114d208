"""Typed, frozen configuration for a training run, and its validation.

One source of truth: the CLI (``ptdp.cli``) builds these dataclasses, :func:`resolve` checks every
rule and fills derived values *before any process or process group exists*, and the workers receive
the resolved object. Every rule that fails is reported at once in a single :class:`ConfigError`
that names the values involved and the rule.

Rules (sources: Narayanan et al. SC21, arXiv:2104.04473; Shoeybi et al., arXiv:1909.08053):

- ``world_size == tp * pp * dp``
- ``num_attention_heads % tp == 0`` (attention is split by heads), ``hidden_size % heads == 0``
- ``ffn_hidden_size % tp == 0`` (the MLP's first linear is split by columns)
- ``num_layers % pp == 0`` unless an explicit ``pipeline_layer_split`` is given, which must have
  ``pp`` positive entries summing to ``num_layers`` (no layer is ever dropped silently)
- ``global_batch_size % (micro_batch_size * dp) == 0``; the number of microbatches per pipeline per
  step is ``m = global_batch_size / (micro_batch_size * dp)``
- the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp``
- activation recomputation: ``recompute_method`` and ``recompute_num_layers`` need ``full``
  granularity, and ``1 <= recompute_num_layers <=`` the layers of the smallest model chunk
- grouped-query attention: ``heads % num_query_groups == 0`` and ``num_query_groups % tp == 0``
  (each tp rank holds whole key/value heads); rotary embeddings need an even head dim
- sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2) needs ``tp > 1`` and
  ``seq_length % tp == 0`` (each tp rank holds ``s / tp`` positions)
- dropout probabilities ``hidden_dropout`` and ``attention_dropout`` in ``[0, 1)``
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "float64", "bfloat16", "float16")
BIND_POLICIES = ("none", "numa", "exclusive")
MIN_VOCAB_SIZE = 258  # 256 byte symbols + end-of-document token + at least one merge


class ConfigError(ValueError):
    """An invalid configuration; the message names every broken rule and the values involved."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the GPT model: pre-norm; by default LayerNorm, learned positions, a GELU MLP and
    biases, with the options of Llama-like models (RMSNorm, SwiGLU, rotary positions,
    grouped-query attention, no linear biases, an untied output layer)."""

    num_layers: int = 4
    """Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int = 128
    """Width h of the residual stream."""
    num_attention_heads: int = 4
    """Attention heads a; each has h / a channels."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer; None means 4 * hidden_size."""
    seq_length: int = 128
    """Tokens per sample s (also the number of learned positions)."""
    vocab_size: int = 4096
    """Size of the tokenizer to train (before padding)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times tp; padded rows never affect the loss."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of sharing the input embedding."""
    params_dtype: str = "float32"
    """dtype of parameters and activations: float32, float64, bfloat16 or float16 (the 16-bit
    ones with float32 main parameters and gradients; float16 with dynamic loss scaling)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"
    """MLP activation: ``gelu`` (exact, erf) or ``gelu_tanh`` (the tanh approximation GPT-2 uses);
    unused with ``swiglu``."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only: ``x / rms(x) * weight``)."""
    swiglu: bool = False
    """Gated MLP: fc1 makes a gate and an up projection, each ``ffn`` wide, and the MLP computes
    ``fc2(silu(gate) * up)`` (Shazeer 2020, arXiv:2002.05202)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a learned ``[s, h]`` table added to the token embeddings) or ``rope``
    (rotary embeddings applied to q and k in every layer, no position table; Su et al. 2021,
    arXiv:2104.09864)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies: channel pair i of a head turns by ``pos * base^(-2i/d)``."""
    num_query_groups: int | None = None
    """Key/value heads G for grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), each
    shared by a / G query heads; None: ordinary multi-head attention (a key/value heads)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (QKV, attention output, fc1, fc2); norms keep theirs."""
    hidden_dropout: float = 0.0
    """Dropout probability of the hidden states ``[b, s, h]`` after the embeddings, after the
    attention projection and after fc2 (before the residual adds); 0 disables. Masks come from
    :class:`ptdp.tensor_parallel.random.DropoutRNG` streams: equal on the tp ranks of a replica,
    different over dp replicas."""
    attention_dropout: float = 0.0
    """Dropout probability of the attention probabilities; 0 disables. With it, attention is
    computed explicitly (scores, causal softmax, dropout, context; the ``s x s`` probabilities are
    kept for backward) instead of by the fused ``scaled_dot_product_attention`` kernel, whose own
    dropout draws from torch's default generator and cannot follow ptdp's per-head streams."""
    recompute_granularity: str | None = None
    """Activation recomputation (Korthikanti et al. 2022, arXiv:2205.05198; ``ptdp.model.recompute``):
    None keeps every activation; ``full`` keeps only the inputs of groups of layers and recomputes
    the groups in backward; ``selective`` recomputes only the attention core (scores, softmax,
    context). Results are identical; it trades compute for activation memory."""
    recompute_method: str | None = None
    """With ``full``: ``uniform`` (every layer of each model chunk, in groups of
    ``recompute_num_layers``) or ``block`` (only the first ``recompute_num_layers`` layers of each
    model chunk, one by one). None with ``full``: uniform."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per recomputed group (uniform) or recomputed layers per model chunk
    (block). None with ``full``: 1 for uniform (every layer's input kept); block needs it."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per query head without it."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel axes; 1 means the axis is not used."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int | None = None
    """None: inferred as world_size / (tp * pp)."""
    pipeline_layer_split: tuple[int, ...] | None = None
    """Explicit layers per pipeline stage (pp entries summing to num_layers); None: even split."""
    pipeline_schedule: str | None = None
    """gpipe, 1f1b or interleaved-1f1b; None: interleaved-1f1b when
    num_layers_per_virtual_pipeline_stage is set, else 1f1b."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per model chunk; each rank then holds v = num_layers / (pp * this) chunks."""
    sequence_parallel: bool = False
    """Split the activations outside the tensor-parallel regions (norms, residual adds, the
    embedding output) along the sequence over tp, ``[b, s/tp, h]`` per rank (Korthikanti et al.
    2022, §4.2.2): the tp all-reduces become all-gathers and reduce-scatters of the same total,
    those activations take 1/tp of the memory, and pipeline transfers carry ``[b, s/tp, h]``.
    Needs tp > 1 and ``seq_length % tp == 0``."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every process group, in minutes (fractions allowed): a collective or transfer
    that waits longer fails the job with a message naming the rank, phase and iteration instead of
    hanging. 10 as in Megatron-LM; ``ptdp train`` on a machine without CUDA defaults to 2."""
    ddp_bucket_size: int | None = None
    """Most gradient elements per data-parallel bucket; None: 40 million (Megatron's default)."""
    overlap_grad_reduce: bool = False
    """Start each bucket's data-parallel reduction during the last microbatch's backward."""
    grad_compression: str = "none"
    """Data-parallel gradient reduction in none (fp32), fp16, bf16 or 1bit (with error feedback)."""
    grad_compression_warmup_iters: int | None = None
    """First iterations reduced exactly (fp32) before the codec starts; None: the learning-rate
    warmup for 1bit, 0 for fp16/bf16."""
    use_distributed_optimizer: bool = False
    """Shard Adam's state (and float32 main parameters) over dp (ZeRO-1)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated parameters asynchronously; each module's forward
    waits only for the buckets holding its own parameters."""
    bind_cpus: str = "none"
    """CPU binding of each worker at start-up: none (leave the affinity alone), numa (the allowed
    CPUs of its GPU's NUMA node; without GPUs, of the node it is spread to) or exclusive (a
    non-overlapping share of them); see :mod:`ptdp.topology.binding`."""

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def schedule(self) -> str:
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved-1f1b" if self.num_layers_per_virtual_pipeline_stage else "1f1b"

    def virtual_stages(self, num_layers: int) -> int:
        """v, the model chunks per pipeline rank."""
        per_chunk = self.num_layers_per_virtual_pipeline_stage
        return num_layers // (self.pp * per_chunk) if per_chunk else 1

    @property
    def dp(self) -> int:
        if self.data_parallel_size is None:
            raise ConfigError("data_parallel_size is not resolved yet; call ptdp.config.resolve")
        return self.data_parallel_size


@dataclass(frozen=True)
class TrainConfig:
    """Batches, optimizer (AdamW) and learning-rate schedule (linear warmup, cosine decay)."""

    micro_batch_size: int = 4
    """Samples b in one microbatch on one data-parallel rank."""
    global_batch_size: int = 32
    """Samples B in one optimizer step over all data-parallel ranks."""
    train_iters: int = 300
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 30
    lr_decay_iters: int | None = None
    """Iterations of cosine decay after which lr stays at min_lr; None: train_iters."""
    weight_decay: float = 0.1
    """Decoupled weight decay on tensors with >= 2 dims (weights, word and position embeddings);
    none on biases and LayerNorm parameters."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    max_skipped_steps: int = 10
    """A step whose loss or gradient norm is nan/inf on any rank is skipped (no update); training
    stops with an error at the step that makes more than this many such steps in a row. 0: stop
    at the first one."""
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    """Global batches of validation data per evaluation."""
    trace_iters: int = 0
    """Iterations to trace (from the second on) into trace.json and timeline.png; 0: no trace."""

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters


ACTIVATIONS = ("gelu", "gelu_tanh")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints are saved and loaded (``ptdp.checkpoint``)."""

    save: str | None = None
    """Checkpoint root to save into (one folder per iteration, ``latest`` marker); None: no saving."""
    save_interval: int | None = None
    """Save every N iterations (and always after the last one); None: only after the last one."""
    load: str | None = None
    """Checkpoint root (or iteration folder) to resume from, at any layout."""
    keep_last: int | None = None
    """Keep only the newest K complete checkpoints; None: keep all."""
    no_load_optim: bool = False
    """Load parameters only (fresh Adam state)."""
    no_load_rng: bool = False
    """Do not restore the random number generators."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and where its tokenized form is cached."""

    data_paths: tuple[str, ...] = ()
    """Files or folders of text/jsonl; empty: the Python standard library's .py sources."""
    data_cache_dir: str | None = None
    """Folder for the tokenizer and token files; None: $PTDP_CACHE_DIR or ~/.cache/ptdp."""
    valid_fraction: float = 0.02
    """Fraction of documents held out for validation (split by document, never inside one)."""


@dataclass(frozen=True)
class Config:
    """A whole run: model, parallel layout, training and data settings, and the output folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str | None = None
    hardware_profile: str | None = None
    """Profile from ``ptdp plan --calibrate`` used to predict the run's step time; None: the
    default location if it exists."""

    @property
    def num_microbatches(self) -> int:
        """m = B / (b * dp): microbatches per pipeline per optimizer step."""
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)

    @property
    def grad_compression_warmup(self) -> int:
        """Iterations (0-based steps ``< this``) whose gradients are reduced exactly in fp32."""
        p = self.parallel
        if p.grad_compression == "none":
            return 0
        if p.grad_compression_warmup_iters is not None:
            return p.grad_compression_warmup_iters
        return self.train.lr_warmup_iters if p.grad_compression == "1bit" else 0

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.tp * p.pp * p.dp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        parallel = dict(d["parallel"])
        if parallel.get("pipeline_layer_split") is not None:
            parallel["pipeline_layer_split"] = tuple(parallel["pipeline_layer_split"])
        data = dict(d["data"])
        data["data_paths"] = tuple(data.get("data_paths", ()))
        return cls(
            model=ModelConfig(**d["model"]),
            parallel=ParallelConfig(**parallel),
            train=TrainConfig(**d["train"]),
            data=DataConfig(**data),
            checkpoint=CheckpointConfig(**d.get("checkpoint", {})),
            output_dir=d.get("output_dir"),
            hardware_profile=d.get("hardware_profile"),
        )


def _checkpoint_rules(c: CheckpointConfig) -> list[str]:
    errors = _positive({name: getattr(c, name) for name in ("save_interval", "keep_last")
                        if getattr(c, name) is not None})
    if c.save is None:
        errors += [f"{name}={getattr(c, name)} needs a save directory (--save)"
                   for name in ("save_interval", "keep_last") if getattr(c, name) is not None]
    if c.load is None:
        errors += [f"{name} needs --load" for name in ("no_load_optim", "no_load_rng") if getattr(c, name)]
    return errors


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by * tp`` (Megatron's padding rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layer_counts(num_layers: int, pp: int, split: tuple[int, ...] | None) -> list[int]:
    """Layers held by each of the pp stages; raises ConfigError if they do not add up exactly."""
    if split is None:
        if num_layers % pp != 0:
            raise ConfigError(
                f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp} "
                f"(rule: num_layers % pp == 0); give an explicit --pipeline-layer-split to split "
                f"unevenly"
            )
        return [num_layers // pp] * pp
    if len(split) != pp or any(n < 1 for n in split) or sum(split) != num_layers:
        raise ConfigError(
            f"pipeline_layer_split={list(split)} must have pp={pp} entries, each >= 1, summing to "
            f"num_layers={num_layers} (sum is {sum(split)})"
        )
    return list(split)


def resolve(config: Config, world_size: int) -> Config:
    """Check every rule for ``world_size`` processes and return the config with dp filled in.

    Raises:
        ConfigError: listing every broken rule with its values. Never touches torch.distributed.
    """
    errors: list[str] = []
    p, m, t = config.parallel, config.model, config.train
    errors += _positive(
        {
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "ffn_hidden_size": m.ffn,
            "seq_length": m.seq_length,
            "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
            "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size,
            "train_iters": t.train_iters,
            "log_interval": t.log_interval,
            "eval_interval": t.eval_interval,
            "world_size": world_size,
        }
        | ({"data_parallel_size": p.data_parallel_size} if p.data_parallel_size is not None else {})
    )
    errors += _finite(config)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    dp = _resolve_dp(p, world_size, errors)
    errors += layout_errors(
        m, tp=p.tp, pp=p.pp, dp=dp, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, split=p.pipeline_layer_split,
    )
    errors += _train_rules(t)
    if not errors:
        errors += schedule_errors(p, m.num_layers, t.global_batch_size // (t.micro_batch_size * dp))
    errors += recompute_errors(m, None if errors else chunk_layer_counts(p, m.num_layers))
    errors += sequence_parallel_errors(m, p.tp, p.sequence_parallel)
    errors += _data_parallel_rules(p)
    errors += _checkpoint_rules(config.checkpoint)
    errors += [f"{name}={value} must be in [0, 1) (a dropout probability; 0 disables)"
               for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout))
               if not 0 <= value < 1]
    if m.activation not in ACTIVATIONS:
        errors.append(f"activation={m.activation!r} must be one of {ACTIVATIONS}")
    elif m.swiglu and m.activation != "gelu":
        errors.append(f"activation={m.activation!r} has no effect with swiglu (the gate uses silu)")
    if config.data.valid_fraction <= 0 or config.data.valid_fraction >= 1:
        errors.append(f"valid_fraction={config.data.valid_fraction} must be in (0, 1)")
    if p.distributed_timeout_minutes <= 0:
        errors.append(
            f"distributed_timeout_minutes={p.distributed_timeout_minutes} must be > 0"
        )
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(p, data_parallel_size=dp, pipeline_schedule=p.schedule),
        model=dataclasses.replace(m, ffn_hidden_size=m.ffn, **_recompute_defaults(m)),
        train=dataclasses.replace(t, lr_decay_iters=t.decay_iters),
    )


def _finite(config: Config) -> list[str]:
    """Every float setting must be a finite number (nan or inf would train silently wrong)."""
    values = {
        "lr": config.train.lr, "min_lr": config.train.min_lr, "weight_decay": config.train.weight_decay,
        "adam_beta1": config.train.adam_beta1, "adam_beta2": config.train.adam_beta2,
        "adam_eps": config.train.adam_eps, "clip_grad": config.train.clip_grad,
        "init_method_std": config.model.init_method_std, "layernorm_epsilon": config.model.layernorm_epsilon,
        "rotary_base": config.model.rotary_base,
        "hidden_dropout": config.model.hidden_dropout, "attention_dropout": config.model.attention_dropout,
        "valid_fraction": config.data.valid_fraction,
        "distributed_timeout_minutes": config.parallel.distributed_timeout_minutes,
    }
    return [
        f"{name}={value!r} must be a finite number"
        for name, value in values.items()
        if not isinstance(value, (int, float)) or not math.isfinite(value)
    ]


def _positive(values: dict[str, int]) -> list[str]:
    return [
        f"{name}={value!r} must be a positive integer"
        for name, value in values.items()
        if not isinstance(value, int) or isinstance(value, bool) or value < 1
    ]


def _resolve_dp(p: ParallelConfig, world_size: int, errors: list[str]) -> int:
    tp, pp = p.tp, p.pp
    if p.data_parallel_size is None:
        if world_size % (tp * pp) != 0:
            errors.append(
                f"world_size={world_size} is not divisible by tp*pp={tp}*{pp}={tp * pp} "
                f"(rule: world_size = tp * pp * dp)"
            )
            return 1
        return world_size // (tp * pp)
    dp = p.data_parallel_size
    if not isinstance(dp, int) or dp < 1:
        errors.append(f"data_parallel_size={dp!r} must be a positive integer")
        return 1
    if tp * pp * dp != world_size:
        errors.append(
            f"world_size={world_size} != tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} "
            f"(rule: world_size = tp * pp * dp)"
        )
    return dp


def layout_errors(
    m: ModelConfig, *, tp: int, pp: int, dp: int, micro_batch_size: int, global_batch_size: int,
    split: tuple[int, ...] | None = None,
) -> list[str]:
    """The rules tying a model and batch to a tp x pp x dp layout, one message per broken rule.

    Shared by :func:`resolve` and the planner, so every layout the planner proposes can run.
    """
    errors = _model_rules(m, tp, pp, split)
    b, big_b = micro_batch_size, global_batch_size
    if big_b % (b * dp) != 0:
        errors.append(
            f"global_batch_size={big_b} is not divisible by micro_batch_size*dp = {b}*{dp} = "
            f"{b * dp} (rule: B % (b * dp) == 0)"
        )
    return errors


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def schedule_errors(p: ParallelConfig, num_layers: int, num_microbatches: int) -> list[str]:
    """Rules of the pipeline schedule (Narayanan et al. SC21, §2.2), one message per broken rule."""
    kind, per_chunk, pp, m = p.schedule, p.num_layers_per_virtual_pipeline_stage, p.pp, num_microbatches
    if kind not in SCHEDULES:
        return [f"pipeline_schedule={kind!r} must be one of {SCHEDULES}"]
    errors = []
    if per_chunk is not None:
        if not isinstance(per_chunk, int) or per_chunk < 1:
            return [f"num_layers_per_virtual_pipeline_stage={per_chunk!r} must be a positive integer"]
        if num_layers % (pp * per_chunk):
            errors.append(
                f"num_layers={num_layers} is not divisible by pp * num_layers_per_virtual_pipeline_stage = "
                f"{pp}*{per_chunk} = {pp * per_chunk} (rule: layers split evenly over pp * v model chunks)"
            )
        if kind != "interleaved-1f1b":
            errors.append(f"num_layers_per_virtual_pipeline_stage needs the interleaved-1f1b schedule, not {kind}")
        if p.pipeline_layer_split is not None:
            errors.append("pipeline_layer_split cannot be combined with virtual pipeline stages")
    if kind == "interleaved-1f1b":
        if per_chunk is None:
            errors.append("the interleaved-1f1b schedule needs num_layers_per_virtual_pipeline_stage")
        if pp < 2:
            errors.append(f"the interleaved-1f1b schedule needs pipeline_model_parallel_size >= 2, got {pp}")
        elif m % pp:
            errors.append(
                f"the interleaved-1f1b schedule needs num_microbatches % pp == 0: num_microbatches={m} "
                f"(= global_batch_size / (micro_batch_size * dp)), pp={pp}"
            )
    return errors


def sequence_parallel_errors(m: ModelConfig, tp: int, sequence_parallel: bool) -> list[str]:
    """Rules of sequence parallelism (Korthikanti et al. 2022, §4.2.2), one message per broken rule."""
    if not sequence_parallel:
        return []
    if tp < 2:
        return [f"sequence_parallel needs tensor_model_parallel_size > 1, got {tp} (rule: the sequence is split "
                f"over the tp ranks)"]
    if m.seq_length % tp:
        return [f"seq_length={m.seq_length} is not divisible by tensor_model_parallel_size={tp} (rule: s % tp == 0 "
                f"with sequence_parallel; each tp rank holds s / tp positions)"]
    return []


GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "1bit")


def _data_parallel_rules(p: ParallelConfig) -> list[str]:
    errors = []
    if p.grad_compression not in GRAD_COMPRESSIONS:
        errors.append(f"grad_compression={p.grad_compression!r} must be one of {GRAD_COMPRESSIONS}")
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        errors.append("overlap_param_gather needs use_distributed_optimizer (only the distributed optimizer "
                      "all-gathers parameters)")
    if p.grad_compression == "1bit" and p.use_distributed_optimizer:
        errors.append("grad_compression=1bit cannot be combined with use_distributed_optimizer "
                      "(1-bit gradients are all-gathered, not reduce-scattered)")
    warmup = p.grad_compression_warmup_iters
    if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
        errors.append(f"grad_compression_warmup_iters={warmup!r} must be an integer >= 0")
    elif warmup is not None and p.grad_compression == "none":
        errors.append(f"grad_compression_warmup_iters={warmup} has no effect with grad_compression=none")
    if p.ddp_bucket_size is not None and (not isinstance(p.ddp_bucket_size, int) or p.ddp_bucket_size < 1):
        errors.append(f"ddp_bucket_size={p.ddp_bucket_size!r} must be a positive integer (elements)")
    if p.bind_cpus not in BIND_POLICIES:
        errors.append(f"bind_cpus={p.bind_cpus!r} must be one of {BIND_POLICIES}")
    return errors


def _model_rules(m: ModelConfig, tp: int, pp: int, split: tuple[int, ...] | None) -> list[str]:
    errors = []
    a, h = m.num_attention_heads, m.hidden_size
    if a % tp != 0:
        errors.append(
            f"num_attention_heads={a} is not divisible by tensor_model_parallel_size={tp} "
            f"(rule: heads % tp == 0; attention is split by heads)"
        )
    if h % a != 0:
        errors.append(f"hidden_size={h} is not divisible by num_attention_heads={a} (rule: h % a == 0)")
    if m.ffn % tp != 0:
        errors.append(
            f"ffn_hidden_size={m.ffn} is not divisible by tensor_model_parallel_size={tp} "
            f"(rule: ffn % tp == 0)"
        )
    errors += _llama_option_rules(m, tp)
    try:
        stage_layer_counts(m.num_layers, pp, split)
    except ConfigError as e:
        errors.append(str(e))
    if m.vocab_size < MIN_VOCAB_SIZE:
        errors.append(f"vocab_size={m.vocab_size} must be >= {MIN_VOCAB_SIZE} (256 bytes + end token + merges)")
    if m.params_dtype not in DTYPES:
        errors.append(f"params_dtype={m.params_dtype!r} must be one of {DTYPES}")
    if m.init_method_std <= 0:
        errors.append(f"init_method_std={m.init_method_std} must be > 0")
    return errors


def _llama_option_rules(m: ModelConfig, tp: int) -> list[str]:
    """Normalization, positions and grouped-query attention (the options of Llama-like models)."""
    errors = []
    a, g = m.num_attention_heads, m.num_query_groups
    if m.normalization not in NORMALIZATIONS:
        errors.append(f"normalization={m.normalization!r} must be one of {NORMALIZATIONS}")
    if m.position_embedding_type not in POSITION_EMBEDDINGS:
        errors.append(f"position_embedding_type={m.position_embedding_type!r} must be one of {POSITION_EMBEDDINGS}")
    elif m.position_embedding_type == "rope" and a > 0 and m.hidden_size % a == 0 and (m.hidden_size // a) % 2:
        errors.append(f"head dim hidden_size / num_attention_heads = {m.hidden_size}/{a} = {m.hidden_size // a} "
                      f"is odd (rule: rotary embeddings turn pairs of channels, the head dim must be even)")
    if not m.rotary_base > 0:
        errors.append(f"rotary_base={m.rotary_base} must be > 0")
    if g is None:
        return errors
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        errors.append(f"num_query_groups={g!r} must be a positive integer")
        return errors
    if a % g:
        errors.append(f"num_attention_heads={a} is not divisible by num_query_groups={g} "
                      f"(rule: heads % groups == 0; each key/value head serves a / G query heads)")
    if g % tp:
        errors.append(f"num_query_groups={g} is not divisible by tensor_model_parallel_size={tp} "
                      f"(rule: query groups must divide by tp; each tp rank holds whole key/value heads)")
    return errors


def _train_rules(t: TrainConfig) -> list[str]:
    errors = []
    if not t.lr > 0:
        errors.append(f"lr={t.lr} must be > 0")
    if not 0 <= t.min_lr <= t.lr:
        errors.append(f"min_lr={t.min_lr} must be in [0, lr={t.lr}]")
    if t.lr_warmup_iters < 0 or t.lr_warmup_iters > t.decay_iters:
        errors.append(
            f"lr_warmup_iters={t.lr_warmup_iters} must be in [0, lr_decay_iters={t.decay_iters}]"
        )
    if t.weight_decay < 0:
        errors.append(f"weight_decay={t.weight_decay} must be >= 0")
    if t.clip_grad < 0:
        errors.append(f"clip_grad={t.clip_grad} must be >= 0 (0 disables clipping)")
    if not (0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1) or t.adam_eps <= 0:
        errors.append(
            f"adam betas ({t.adam_beta1}, {t.adam_beta2}) must be in [0, 1) and adam_eps={t.adam_eps} > 0"
        )
    if t.eval_iters < 0:
        errors.append(f"eval_iters={t.eval_iters} must be >= 0 (0 disables evaluation)")
    if not isinstance(t.max_skipped_steps, int) or t.max_skipped_steps < 0:
        errors.append(f"max_skipped_steps={t.max_skipped_steps!r} must be an integer >= 0 "
                      f"(0: stop at the first non-finite step)")
    if t.trace_iters < 0:
        errors.append(f"trace_iters={t.trace_iters} must be >= 0 (0 disables tracing)")
    if not 0 <= t.seed < 2**63:
        errors.append(f"seed={t.seed} must be in [0, 2**63)")
    return errors


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def chunk_layer_counts(p: ParallelConfig, num_layers: int) -> list[int]:
    """Layers of each model chunk (a stage, or a virtual stage when interleaved), the unit that
    recomputation works on; the layout rules must hold."""
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    if per_chunk:
        return [per_chunk] * (num_layers // per_chunk)
    return stage_layer_counts(num_layers, p.pp, p.pipeline_layer_split)


def recompute_errors(m: ModelConfig, chunk_layers: list[int] | None) -> list[str]:
    """Rules of activation recomputation, one message per broken rule; ``chunk_layers``: the layers
    of every model chunk (None when the layout is invalid: the range of recompute_num_layers is
    then not checked)."""
    granularity, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
        return [f"recompute_granularity={granularity!r} must be one of {RECOMPUTE_GRANULARITIES} (or unset: no recompute)"]
    errors = []
    if method is not None and method not in RECOMPUTE_METHODS:
        errors.append(f"recompute_method={method!r} must be one of {RECOMPUTE_METHODS}")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        errors.append(f"recompute_num_layers={n!r} must be a positive integer")
        n = None
    if granularity != "full":
        errors += [f"{name}={value!r} needs recompute_granularity=full, not {granularity!r}"
                   for name, value in (("recompute_method", method), ("recompute_num_layers", m.recompute_num_layers))
                   if value is not None]
        return errors
    if method == "block" and m.recompute_num_layers is None:
        errors.append("recompute_method=block needs recompute_num_layers (the layers recomputed per model chunk)")
    if n is not None and chunk_layers and n > min(chunk_layers):
        errors.append(
            f"recompute_num_layers={n} is more than the {min(chunk_layers)} layers of the smallest model chunk "
            f"(layers per chunk: {chunk_layers}; rule: 1 <= recompute_num_layers <= layers per model chunk)"
        )
    return errors


def _recompute_defaults(m: ModelConfig) -> dict:
    """Full recompute without a method or count: uniform, one layer per group."""
    if m.recompute_granularity != "full":
        return {}
    method = m.recompute_method or "uniform"
    return {"recompute_method": method, "recompute_num_layers": m.recompute_num_layers or (1 if method == "uniform" else None)}
