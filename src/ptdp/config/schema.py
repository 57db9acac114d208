"""A whole run's configuration: the model and layout sections, training, data, checkpoints and
the local launch (sections of the schema, :mod:`ptdp.config.fields`)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ptdp.config.fields import opt
from ptdp.config.fp8 import FP8Config
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import PipelineSplit


@dataclass(frozen=True)
class TrainConfig:
    """Batches, optimizer (AdamW) and learning-rate schedule (linear warmup, cosine decay)."""

    micro_batch_size: int = opt(
        4, "--micro-batch-size", "samples b per microbatch", "train", aliases=("--mbs",), plan=True
    )
    """Samples b in one microbatch on one data-parallel rank."""
    global_batch_size: int = opt(
        32,
        "--global-batch-size",
        "samples B per optimizer step, all dp replicas together",
        "train",
        aliases=("--gbs",),
        plan=True,
    )
    """Samples B in one optimizer step over all data-parallel ranks."""
    train_iters: int = opt(300, "--train-iters", "optimizer steps", "train")
    """Optimizer steps of the run."""
    lr: float = opt(3e-3, "--lr", "peak learning rate (AdamW)", "train")
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = opt(3e-4, "--min-lr", "learning rate at the end of the cosine decay", "train")
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int | None = opt(
        None, "--lr-warmup-iters", "linear warmup steps (default: --lr-warmup-fraction of the decay steps)", "train"
    )
    """Iterations of linear warmup from 0 to ``lr``; None: ``lr_warmup_fraction`` of the decay
    iterations. Given, it wins over the fraction."""
    lr_warmup_fraction: float = opt(
        0.1,
        "--lr-warmup-fraction",
        "share of the decay steps spent in linear warmup, when --lr-warmup-iters is not given",
        "train",
    )
    """Warmup as a share of ``lr_decay_iters`` (Megatron-LM's ``--lr-warmup-fraction``), rounded
    down, used when ``lr_warmup_iters`` is None; in [0, 1]."""
    lr_decay_iters: int | None = opt(None, "--lr-decay-iters", "cosine decay steps (default: --train-iters)", "train")
    """Iterations of cosine decay after which lr stays at min_lr; None: train_iters."""
    weight_decay: float = opt(0.1, "--weight-decay", "decoupled weight decay on weights and embeddings", "train")
    """Decoupled weight decay on tensors with >= 2 dims (weights, word and position embeddings);
    none on biases and LayerNorm parameters."""
    adam_beta1: float = opt(0.9, "--adam-beta1", "AdamW beta1", "train")
    """AdamW's first-moment decay."""
    adam_beta2: float = opt(0.95, "--adam-beta2", "AdamW beta2", "train")
    """AdamW's second-moment decay."""
    adam_eps: float = opt(1e-8, "--adam-eps", "AdamW epsilon", "train")
    """AdamW's epsilon, added to the square root of the second moment."""
    clip_grad: float = opt(1.0, "--clip-grad", "global gradient-norm clip; 0 disables", "train")
    """Clip the global gradient norm to this; 0 disables clipping."""
    enable_optimizer_post_validation: bool = opt(
        False,
        "--enable-optimizer-post-validation",
        "update before the global gradient norm and the non-finite flags are known, then roll back "
        "and redo the update where they clip or skip the step (Qi et al., arXiv:2401.10241, §4)",
        "train",
    )
    """Optimizer post-validation: each rank updates unclipped and unskipped while the world
    all-reduce of the step's global state (gradient norm, non-finite and float16 overflow flags) is
    in flight, then restores what the update wrote and updates again where the state clips or
    skips the step; the result equals the synchronous step. Costs a copy of the optimizer's
    parameters and moments during the step (:mod:`ptdp.engine.optim.post_validation`)."""
    max_skipped_steps: int = opt(
        10,
        "--max-skipped-steps",
        "a step with a nan/inf loss or gradient norm on any "
        "rank is skipped; stop when more than N come in a row (0: at the first)",
        "train",
        metavar="N",
    )
    """A step whose loss or gradient norm is nan/inf on any rank is skipped (no update); training
    stops with an error at the step that makes more than this many such steps in a row. 0: stop
    at the first one."""
    seed: int = opt(1234, "--seed", "seed of weight init, data order and dropout", "train")
    """Seed of the layout-independent weight initialisation, the data order and dropout."""
    log_interval: int = opt(10, "--log-interval", "write a metrics.jsonl line every N steps", "data")
    """Steps between two metrics lines (the first and last are always written)."""
    eval_interval: int = opt(100, "--eval-interval", "evaluate validation loss every N steps", "data")
    """Steps between two evaluations (also at iteration 0 and at the end)."""
    eval_iters: int = opt(4, "--eval-iters", "global batches per evaluation; 0 disables", "data")
    """Global batches of validation data per evaluation."""
    trace: bool = opt(
        False,
        "--trace",
        "record every rank's forward/backward/send/receive/wait times into "
        "trace.json and timeline.png, and the bubble per rank in the summary",
        "data",
    )
    """Trace ``trace_iters`` iterations (from the second on) into trace.json and timeline.png."""
    trace_iters: int = opt(3, "--trace-iters", "iterations traced with --trace, from the second on", "data")
    """Iterations traced with ``trace``."""
    profile: bool = opt(
        False,
        "--profile",
        "write a torch.profiler trace (CPU, and CUDA on GPUs) of steps "
        "--profile-step-start..--profile-step-end on --profile-ranks into the run directory",
        "data",
    )
    """Profile steps ``[profile_step_start, profile_step_end)`` (0-based; iterations start+1 .. end of
    metrics.jsonl) with ``torch.profiler`` on ``profile_ranks``; each writes ``profile/rank<r>.json``
    (Chrome trace) in the run directory."""
    profile_step_start: int = opt(
        10, "--profile-step-start", "first profiled step (0-based, as in Megatron-LM)", "data", metavar="N"
    )
    """First profiled step (0-based: the step that logs iteration N + 1)."""
    profile_step_end: int = opt(
        12,
        "--profile-step-end",
        "profiling stops before this step (0-based); at most --train-iters",
        "data",
        metavar="N",
    )
    """Profiling stops before this 0-based step; ``profile_step_start < profile_step_end <= train_iters``."""
    profile_ranks: tuple[int, ...] = opt(
        (0,), "--profile-ranks", "global ranks to profile (comma list)", "data", metavar="R,..."
    )
    """Global ranks that profile (each ``< world_size``)."""
    tensorboard_dir: str | None = opt(
        None,
        "--tensorboard-dir",
        "also write the metrics.jsonl scalars as TensorBoard events into DIR (needs ptdp[tensorboard])",
        "data",
        metavar="DIR",
    )
    """Folder of TensorBoard event files (``torch.utils.tensorboard``), written by global rank 0
    at every metrics line (:mod:`ptdp.run.tracking`); None: none."""
    wandb_project: str | None = opt(
        None,
        "--wandb-project",
        "also log the metrics.jsonl scalars to this Weights & "
        "Biases project (offline without WANDB_API_KEY; needs ptdp[wandb])",
        "data",
        metavar="NAME",
    )
    """Weights & Biases project the scalars go to (``WANDB_MODE``, else offline unless
    ``WANDB_API_KEY`` is set); None: no W&B."""
    wandb_exp_name: str | None = opt(
        None, "--wandb-exp-name", "the W&B run's name (default: the run directory's name)", "data", metavar="NAME"
    )
    """Name of the W&B run; None: the run directory's name. Needs ``wandb_project``."""
    wandb_save_dir: str | None = opt(
        None, "--wandb-save-dir", "folder of W&B's local files (default: <run directory>/wandb)", "data", metavar="DIR"
    )
    """Folder W&B writes its run files into; None: ``<run directory>/wandb``. Needs ``wandb_project``."""

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

    @property
    def warmup_iters(self) -> int:
        """``lr_warmup_iters`` when given, else ``floor(lr_warmup_fraction * decay_iters)``."""
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        return math.floor(self.lr_warmup_fraction * self.decay_iters)

    @property
    def traced_iters(self) -> int:
        """Iterations to trace: ``trace_iters`` with ``trace``, else 0."""
        return self.trace_iters if self.trace else 0


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints are saved and loaded (``ptdp.run.checkpoint``)."""

    save: str | None = opt(
        None,
        "--save",
        "save checkpoints into DIR (DIR/iter_NNNNNNN, DIR/latest) after the last iteration",
        "checkpoint",
        metavar="DIR",
    )
    """Checkpoint root to save into (one folder per iteration, ``latest`` marker); None: no saving."""
    save_interval: int | None = opt(None, "--save-interval", "also save every N iterations", "checkpoint", metavar="N")
    """Save every N iterations (and always after the last one); None: only after the last one."""
    load: str | None = opt(
        None,
        "--load",
        "resume from the checkpoint DIR/latest names (or an iteration folder), at any layout",
        "checkpoint",
        metavar="DIR",
    )
    """Checkpoint root (or iteration folder) to resume from, at any layout."""
    keep_last: int | None = opt(None, "--keep-last", "keep only the newest K checkpoints", "checkpoint", metavar="K")
    """Keep only the newest K complete checkpoints; None: keep all."""
    async_save: bool = opt(
        False,
        "--async-save",
        "write checkpoints in the background (copied to CPU memory "
        "first) while training goes on; the next save and the end of training wait for it",
        "checkpoint",
    )
    """Write each checkpoint with ``torch.distributed.checkpoint.async_save``: the state is copied
    into CPU memory, then written by a background thread; it becomes the ``latest`` checkpoint
    when the next save or the end of training has waited for it."""
    no_load_optim: bool = opt(False, "--no-load-optim", "with --load: parameters only, fresh Adam state", "checkpoint")
    """Load parameters only (fresh Adam state)."""
    no_load_rng: bool = opt(False, "--no-load-rng", "with --load: do not restore random generators", "checkpoint")
    """Do not restore the random number generators."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and where its tokenized form is cached."""

    data_paths: tuple[str, ...] = opt(
        (),
        "--data",
        "text, .jsonl, .parquet or .arrow file, a folder of them, or a "
        "datasets save_to_disk folder; repeatable (default: the Python standard "
        "library's .py files)",
        "data",
        metavar="PATH",
        append=True,
    )
    """Files or folders of text, ``.jsonl``, ``.parquet`` or ``.arrow`` files, or Hugging Face
    ``datasets`` folders written by ``save_to_disk`` (the last three need the ``[data]`` extra);
    empty: the Python standard library's .py sources."""
    data_cache_dir: str | None = opt(
        None,
        "--data-cache-dir",
        "where tokenizer and token files are cached (default $PTDP_CACHE_DIR or ~/.cache/ptdp)",
        "data",
    )
    """Folder for the tokenizer and token files; None: $PTDP_CACHE_DIR or ~/.cache/ptdp."""
    valid_fraction: float = opt(0.02, "--valid-fraction", "fraction of documents held out for validation", "data")
    """Fraction of documents held out for validation (split by document, never inside one)."""
    data_text_key: str = opt(
        "text",
        "--data-text-key",
        "the field of .jsonl records and the column of Parquet, Arrow and saved datasets that holds the text",
        "data",
        metavar="NAME",
    )
    """Field of each ``.jsonl`` record, and column of Parquet/Arrow files and ``save_to_disk``
    datasets, that holds a document's text."""
    tokenizer_model: str | None = opt(
        None,
        "--tokenizer-model",
        "a Hugging Face tokenizer.json, or a folder with "
        "one, used as is (default: train a byte-level BPE of --vocab-size)",
        "data",
        metavar="PATH",
    )
    """A Hugging Face ``tokenizer.json`` (or a folder holding one: a model folder, ``ptdp convert
    to-hf``'s output) used as given, never retrained; its size replaces ``--vocab-size``. None:
    train a byte-level BPE of ``vocab_size`` tokens on the corpus."""
    eod_token: str | None = opt(
        None,
        "--eod-token",
        "the token that ends every document with --tokenizer-model, added to its vocabulary when absent "
        "(default: tokenizer_config.json's eos_token, else the first known end-of-text token it has)",
        "data",
        metavar="TEXT",
    )
    """End-of-document token of a ``--tokenizer-model``; added as a special token (id = its size)
    when the tokenizer lacks it. None: found as :func:`ptdp.data.tokenizer.load_tokenizer_model`
    says. Needs ``tokenizer_model`` (ptdp's own tokenizer ends documents with ``<|endoftext|>``)."""
    tokenizer_workers: int | None = opt(
        None,
        "--tokenizer-workers",
        "processes that tokenize the corpus (default: "
        "one per CPU core, at most 8, for corpora over 64 MB; else 1: this process)",
        "data",
        metavar="N",
    )
    """Worker processes that encode the corpus into token files (1: this process alone); the files
    are identical for every count. None: ``min(8, cores)`` for corpora over 64 MB, else 1."""


@dataclass(frozen=True)
class LaunchConfig:
    """How ``ptdp train`` starts and watches its local workers (not part of the training itself)."""

    nproc_per_node: int | None = opt(
        None,
        "--nproc-per-node",
        "local worker processes, one per GPU on a GPU "
        "machine (default: TP x PP x DP if --dp is given, else the visible GPUs, or 8 "
        "without GPUs, when TP x PP divides it, else TP x PP)",
        "layout",
        local=True,
    )
    """Workers ``ptdp train`` starts on this machine, at most one per visible GPU; None: see
    :func:`ptdp.config.resolve.local_world_size`."""
    max_restarts: int = opt(
        0,
        "--max-restarts",
        "when a worker dies, restart all workers up to N times; a "
        "restarted job resumes from the newest checkpoint in --save",
        "layout",
        metavar="N",
        local=True,
    )
    """Restarts of all workers after a failure (0: a failed worker ends the run)."""
    force: bool = opt(
        False, "--force", "start even when the planner's memory estimate says the run does not fit", "launch"
    )
    """Start even when the memory estimate says the run cannot fit."""
    overwrite: bool = opt(False, "--overwrite", "allow writing into an existing, non-empty --output-dir", "data")
    """Write into an existing, non-empty run directory."""
    no_progress: bool = opt(False, "--no-progress", "no live progress bar", "data")
    """No live progress bar."""


@dataclass(frozen=True)
class Config:
    """A whole run: model, parallel layout, training, data, checkpoint and launch settings, and
    the output folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    output_dir: str | None = opt(None, "--output-dir", "run directory (default runs/<time>-tpX-ppY-dpZ)", "data")
    """The run directory; None: ``runs/<YYYYmmdd-HHMMSS>-tp<T>-pp<P>-dp<D>``."""
    hardware_profile: str | None = opt(
        None,
        "--hardware-profile",
        "profile from `ptdp plan --calibrate` for the "
        "planner's step-time prediction (default: $PTDP_CACHE_DIR/hardware-profile.json "
        "if it exists)",
        "data",
        metavar="FILE",
    )
    """Profile from ``ptdp plan --calibrate`` used to predict the run's step time; None: the
    default location if it exists."""
    pipeline_split: PipelineSplit | None = field(default=None, compare=False)
    """Where the layers sit, stored by :func:`ptdp.config.resolve.resolve` (None before); derived, not
    a setting: equality and :meth:`to_dict` leave it out. Read it as :attr:`pipeline`."""

    @property
    def pipeline(self) -> PipelineSplit:
        """:attr:`pipeline_split`; raises ``ConfigError`` on a config that was not resolved."""
        if self.pipeline_split is None:
            raise ConfigError("the pipeline split is not resolved yet; call ptdp.config.resolve.resolve")
        return self.pipeline_split

    @property
    def num_microbatches(self) -> int:
        """m = B / (b * dp): microbatches per pipeline per optimizer step."""
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)

    @property
    def grad_compression_warmup(self) -> int:
        """Iterations (0-based steps ``< this``) whose gradients are reduced exactly in fp32."""
        return self.parallel.codec.exact_iters(self.train.warmup_iters)

    @property
    def world_size(self) -> int:
        """tp * cp * pp * dp processes."""
        p = self.parallel
        return p.tp * p.cp * p.pp * p.dp

    def to_dict(self) -> dict[str, Any]:
        """The settings of a run: the resolved :attr:`pipeline_split` and the model settings only
        ``ptdp plan`` takes (:data:`PLAN_ONLY_MODEL_FIELDS`, refused by ``resolve``) left out."""
        out = dataclasses.asdict(self)
        del out["pipeline_split"]
        for name in PLAN_ONLY_MODEL_FIELDS:
            del out["model"][name]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """The config ``to_dict`` wrote (lists back to tuples; a missing section takes its defaults)."""
        parallel = dict(d["parallel"])
        if parallel.get("pipeline_layer_split") is not None:
            parallel["pipeline_layer_split"] = tuple(parallel["pipeline_layer_split"])
        data = dict(d["data"])
        data["data_paths"] = tuple(data.get("data_paths", ()))
        train = dict(d["train"])
        if "profile_ranks" in train:
            train["profile_ranks"] = tuple(train["profile_ranks"])
        moe = dict(d.get("moe", {}))
        if "moe_layer_freq" in moe:
            moe["moe_layer_freq"] = tuple(moe["moe_layer_freq"])
        return cls(
            model=ModelConfig(**d["model"]),
            moe=MoEConfig(**moe),
            fp8=FP8Config(**d.get("fp8", {})),
            parallel=ParallelConfig(**parallel),
            train=TrainConfig(**train),
            data=DataConfig(**data),
            checkpoint=CheckpointConfig(**d.get("checkpoint", {})),
            launch=LaunchConfig(**d.get("launch", {})),
            output_dir=d.get("output_dir"),
            hardware_profile=d.get("hardware_profile"),
        )


PLAN_ONLY_MODEL_FIELDS = ("use_flash_attn", "linear_biases", "kv_repeated")
"""Model fields ``ptdp plan`` reads and ``ptdp train`` refuses (a run on another stack)."""

SECTIONS = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "fp8": FP8Config,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "launch": LaunchConfig,
}
"""The sections of :class:`Config`, by attribute name; its own fields follow them."""
