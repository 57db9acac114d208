"""Rules of the training loop, profiling, checkpoints and the local launch."""

from __future__ import annotations

from ptdp.config.rules.values import positive_violations
from ptdp.config.schema import CheckpointConfig, LaunchConfig, TrainConfig
from ptdp.errors import V, Violation


def train_violations(t: TrainConfig) -> list[Violation]:
    """Learning rate, schedule, optimizer, evaluation, skipping, tracing and seed."""
    out = []
    if not t.lr > 0:
        out.append(V("option", f"lr={t.lr} must be > 0"))
    if not 0 <= t.min_lr <= t.lr:
        out.append(V("option", f"min_lr={t.min_lr} must be in [0, lr={t.lr}]"))
    if not 0 <= t.lr_warmup_fraction <= 1:
        out.append(V("option", f"lr_warmup_fraction={t.lr_warmup_fraction} must be in [0, 1]"))
    elif t.warmup_iters < 0 or t.warmup_iters > t.decay_iters:
        out.append(V("option", f"lr_warmup_iters={t.warmup_iters} must be in [0, lr_decay_iters={t.decay_iters}]"))
    if t.weight_decay < 0:
        out.append(V("option", f"weight_decay={t.weight_decay} must be >= 0"))
    if t.clip_grad < 0:
        out.append(V("option", f"clip_grad={t.clip_grad} must be >= 0 (0 disables clipping)"))
    if not (0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1) or t.adam_eps <= 0:
        out.append(
            V("option", f"adam betas ({t.adam_beta1}, {t.adam_beta2}) must be in [0, 1) and adam_eps={t.adam_eps} > 0")
        )
    if t.eval_iters < 0:
        out.append(V("option", f"eval_iters={t.eval_iters} must be >= 0 (0 disables evaluation)"))
    if not isinstance(t.max_skipped_steps, int) or t.max_skipped_steps < 0:
        out.append(
            V(
                "option",
                f"max_skipped_steps={t.max_skipped_steps!r} must be an integer >= 0 (0: stop at the "
                f"first non-finite step)",
            )
        )
    if t.trace_iters < 0:
        out.append(V("option", f"trace_iters={t.trace_iters} must be >= 0 (0 disables tracing)"))
    if not 0 <= t.seed < 2**63:
        out.append(V("option", f"seed={t.seed} must be in [0, 2**63)"))
    return out


def profile_violations(t: TrainConfig, world_size: int) -> list[Violation]:
    """With ``--profile``: ``0 <= profile_step_start < profile_step_end <= train_iters`` and every
    profiled rank ``< world_size``."""
    if not t.profile:
        return []
    out = []
    start, end = t.profile_step_start, t.profile_step_end
    if not 0 <= start < end <= t.train_iters:
        out.append(
            V(
                "option",
                f"--profile-step-start {start} and --profile-step-end {end} must satisfy "
                f"0 <= start < end <= --train-iters {t.train_iters} (steps are 0-based; Megatron-LM's "
                f"defaults are 10 and 12)",
                profile_step_start=start,
                profile_step_end=end,
                train_iters=t.train_iters,
            )
        )
    bad = [r for r in t.profile_ranks if not 0 <= r < world_size]
    if bad or not t.profile_ranks:
        out.append(
            V(
                "option",
                f"--profile-ranks {','.join(map(str, t.profile_ranks)) or '(none)'}: each rank must be "
                f"in [0, world_size={world_size})",
                profile_ranks=t.profile_ranks,
                world_size=world_size,
            )
        )
    return out


def checkpoint_violations(c: CheckpointConfig) -> list[Violation]:
    out = positive_violations(
        {name: getattr(c, name) for name in ("save_interval", "keep_last") if getattr(c, name) is not None}
    )
    if c.save is None:
        out += [
            V("checkpoint", f"{name}={getattr(c, name)} needs a save directory (--save)")
            for name in ("save_interval", "keep_last")
            if getattr(c, name) is not None
        ]
        if c.async_save:
            out.append(V("checkpoint", "--async-save needs a save directory (--save)"))
    if c.load is None:
        out += [
            V("checkpoint", f"{name} needs --load") for name in ("no_load_optim", "no_load_rng") if getattr(c, name)
        ]
    return out


def launch_violations(launch: LaunchConfig) -> list[Violation]:
    out = []
    n = launch.nproc_per_node
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        out.append(
            V(
                "positive",
                f"nproc_per_node={n} must be a positive integer (local worker processes; default: tp x cp x pp x dp)",
            )
        )
    r = launch.max_restarts
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        out.append(V("option", f"max_restarts={r!r} must be >= 0 (0: a failed worker ends the run)"))
    return out
