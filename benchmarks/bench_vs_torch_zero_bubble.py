"""ptdp's ZB-V and DualPipeV side by side with ``torch.distributed.pipelining``'s
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, on ptdp's GPT.

Both libraries run the same model on the V placement (chunk 0 of rank r = stage r, chunk 1 = stage
2p - 1 - r; rank 0 holds the embedding and the loss, with one tied embedding), the same weights
and the same microbatches:

- ptdp: the rank's stage from ``build_stage`` (its chunks defer the linear layers' weight
  gradients to W), one step = ``run_schedule`` of ``build_programs(kind, p, m, 2)`` with the
  stage's gradient buffer, then ``finalize_grads`` (``train_step`` without clipping and optimizer).
- PyTorch: ``GPTModel`` chunks built with the same layers and placement, the ptdp stage's weights
  copied in (plain autograd: torch's W runs from the retained graph), one ``PipelineStage`` per
  chunk (static shapes; stage index = the chunk's V stage; a process group of its own), and the
  schedule with ``loss_fn`` = the output layer + cross entropy of the last chunk's final hidden
  states in plain torch operations (:func:`_loss_fn`) times 1/m, as ptdp backpropagates its loss,
  and ``scale_grads=False``: torch's scaling divides the parameters of each stage by m after the
  step, so the tied embedding, a parameter of both stages of rank 0, would be divided twice.

A step is forward + backward over the m microbatches, no optimizer. Before timing, one step of each
is compared: per-microbatch losses and every gradient of ptdp, of torch, and of one process running
the whole model (``run_schedule`` at pp = 1) with ``torch.testing.assert_close`` (float64: rtol
1e-9, atol 1e-12; float32 1e-5); the script exits non-zero if they differ. Then the steps
alternate (ptdp, torch), (torch, ptdp), ... (all ranks released by a barrier, step time = the
slowest rank's); the report gives per schedule the medians, their ratio ptdp / torch, the median
of the ratios of the two steps of each iteration and the ratio of the fastest steps.

    python benchmarks/bench_vs_torch_zero_bubble.py            # pp = 2
    python benchmarks/bench_vs_torch_zero_bubble.py --pp 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import pipeline_common as pc
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.data_parallel.grads import finalize_grads
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel, masked_mean
from ptdp.engine.model.model_chunks import ModelChunks, global_named_parameters
from ptdp.engine.pipeline.runtime import Microbatch, run_schedule
from ptdp.engine.stage import Stage, build_stage
from ptdp.engine.tensor_parallel.cross_entropy import IGNORE_INDEX
from ptdp.layout.pipeline.placement import placement_of, virtual_stage
from ptdp.layout.pipeline.program import build_programs
from ptdp.layout.pipeline.schedule import build_schedule

#: (ptdp schedule, torch.distributed.pipelining schedule class)
SCHEDULES = (("zb-v", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV"))
#: assert_close tolerances by parameter dtype
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def gpt_config(args, kind: str, pp: int) -> Config:
    """The resolved config of ``args``' GPT (no vocabulary padding, ``args.dtype``) at pp = ``pp``
    with schedule ``kind`` and ``args.microbatches`` microbatches of ``args.micro_batch_size``."""
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=1,
        params_dtype=args.dtype,
    )
    b = args.micro_batch_size
    train = TrainConfig(micro_batch_size=b, global_batch_size=b * args.microbatches, train_iters=1)
    parallel = ParallelConfig(pipeline_model_parallel_size=pp, pipeline_schedule=kind if pp > 1 else "1f1b")
    return resolve(Config(model=model, parallel=parallel, train=train), pp)


def random_batch(cfg: Config, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[m b, s]`` of one global batch (labels: the tokens shifted by one)."""
    gen = torch.Generator().manual_seed(seed)
    m, t = cfg.model, cfg.train
    data = torch.randint(0, m.vocab_size, (t.global_batch_size, m.seq_length + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def split(tokens: torch.Tensor, labels: torch.Tensor, b: int) -> list[Microbatch]:
    """The ``(tokens, labels)`` microbatches ``[b, s]``, in order (as torch splits along dim 0)."""
    return list(zip(tokens.split(b), labels.split(b)))


def ptdp_step(stage: Stage, microbatches: list[Microbatch]) -> list[torch.Tensor]:
    """One step of the stage's schedule over ``microbatches`` (gradient buffer zeroed first, its
    reductions finished after); returns the last stage's per-microbatch mean losses."""
    cfg, g = stage.config, stage.groups
    kind = cfg.parallel.schedule
    stage.grads.zero()
    program = build_programs(kind, g.pp.size, len(microbatches), stage.virtual_stages)[g.pp.rank]
    losses = run_schedule(
        program,
        stage.model,
        microbatches,
        pp=g.pp,
        hidden_shape=stage.hidden_shape,
        dtype=stage.dtype,
        device=stage.device,
        grad_sync=stage.grads,
        batch_shape=(cfg.train.micro_batch_size, cfg.model.seq_length),
        placement=placement_of(kind),
    )
    finalize_grads(stage.model, stage.grads, g)
    return losses


class FinalHidden(nn.Module):
    """A last-stage chunk without its loss: final-normed hidden states ``[s, b, h]`` (the loss is
    torch's ``loss_fn``)."""

    def __init__(self, chunk: GPTModel) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk.hidden_states(x)


@dataclasses.dataclass
class TorchSide:
    """This rank's torch pipeline: its chunks (ptdp ``GPTModel`` s with plain autograd) and the schedule."""

    chunks: ModelChunks
    schedule: pipelining.schedules.PipelineScheduleMulti
    first: bool

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One ``schedule.step`` over the global batch (tokens ``[m b, s]`` to the first stage,
        labels as targets); returns the per-microbatch losses (scaled by 1/m) on the last stage's rank."""
        for p in self.chunks.parameters():
            p.grad = None
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.first else ()
        self.schedule.step(*args, target=labels, losses=losses, return_outputs=False)
        return losses


def torch_side(stage: Stage, torch_name: str) -> TorchSide:
    """torch.distributed.pipelining's schedule ``torch_name`` over copies of ``stage``'s two V chunks.

    Each copy is a ``GPTModel`` with the same layers and ends as the ptdp chunk, weights loaded from
    it, weight gradients not deferred (W is torch's, from the retained graph); on rank 0 the last
    chunk shares the first's word embedding (tied), as in ptdp. Raises ValueError unless ``stage``
    has two chunks on the V placement.
    """
    cfg, g = stage.config, stage.groups
    kind, p, r = cfg.parallel.schedule, g.pp.size, g.pp.rank
    placement = placement_of(kind)
    mine = stage.chunks
    if placement != "v" or len(mine) != 2 or g.world.size != p:
        raise ValueError(
            f"torch's V schedules here need two chunks on the V placement and pp = world size; "
            f"{kind} has {len(mine)} chunks, pp = {p}, world = {g.world.size}"
        )
    stages = [virtual_stage(r, c, p, placement) for c in range(2)]
    chunks = [
        GPTModel(
            cfg.model,
            g.tp,
            layer_ids=cfg.pipeline.chunk_layer_ids(r, c),
            pre_process=src.pre_process,
            post_process=src.post_process,
        )
        for c, src in enumerate(mine)
    ]
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process and c.tied_embedding() is not None]
    if first and last:  # one parameter, as ptdp's rank 0 (build_stage)
        last[0].word_embeddings = first[0].word_embeddings
    for ours, src in zip(chunks, mine, strict=True):
        ours.load_state_dict(src.state_dict())
    s, b, h = stage.hidden_shape
    n = 2 * p
    dtype, device = stage.dtype, stage.device
    m = cfg.train.global_batch_size // cfg.train.micro_batch_size
    group = dist.new_group(list(g.pp.ranks))  # torch's transfers apart from ptdp's
    torch_stages, loss_fn = [], _no_loss  # a schedule without loss_fn runs no backward, on any rank
    for chunk, k in zip(chunks, stages, strict=True):
        if k == 0:
            inp: torch.Tensor = torch.zeros(b, s, dtype=torch.long, device=device)
        else:  # requires_grad: a stage receives the gradient of what requires one
            inp = torch.empty(s, b, h, dtype=dtype, device=device, requires_grad=True)
        out = torch.empty(s, b, h, dtype=dtype, device=device, requires_grad=True)
        module: nn.Module = chunk
        if k == n - 1:
            module = FinalHidden(chunk)
            loss_fn = _loss_fn(chunk, m)
        torch_stages.append(
            pipelining.PipelineStage(module, k, n, device, input_args=inp, output_args=out, group=group)
        )
    cls = getattr(pipelining, torch_name)
    schedule = cls(torch_stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    return TorchSide(ModelChunks(chunks), schedule, first=bool(first))


def _no_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("only the rank of the last stage computes the loss")


def _loss_fn(chunk: GPTModel, m: int):
    """The last stage's loss from its final hidden states ``[s, b, h]`` and labels ``[b, s]``: the
    output layer (the real vocabulary's rows) and the cross entropy as plain torch operations, the
    mean over the tokens not ignored (``masked_mean``), times 1/m (``run_schedule``'s factor).

    The same function as ptdp's fused ``token_losses``, up to rounding; that one overwrites its
    kept logits in backward (run once per microbatch in ptdp), while torch's split backward runs
    the graph's backward twice (I, then W from the retained graph)."""
    factor = 1.0 / m
    out = chunk.output_layer if hasattr(chunk, "output_layer") else chunk.word_embeddings

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, out.weight[: out.vocab_size])  # [s, b, V]
        target = labels.t().reshape(-1)
        losses = F.cross_entropy(logits.flatten(0, 1), target, reduction="none", ignore_index=IGNORE_INDEX)
        return masked_mean(losses.view(labels.shape[1], labels.shape[0]).t(), labels) * factor

    return loss_fn


_KINDS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def same_compute_order(schedule: pipelining.schedules.PipelineScheduleMulti, kind: str, p: int, m: int) -> bool:
    """Whether every rank runs the same forwards, whole backwards (B), input-gradient (I) and
    weight-gradient (W) backwards, by V stage and microbatch, in the same order in ptdp's
    ``kind`` and in torch's ``schedule`` (its ``pipeline_order``, overlapped F+B pairs unfolded)."""
    ours = build_schedule(kind, p, m, 2)
    for r in range(p):
        mine = [(virtual_stage(r, a.chunk, p, "v"), _KINDS[a.kind], a.microbatch) for a in ours[r] if a.kind in _KINDS]
        theirs = [
            (x.stage_index, _TORCH_KINDS[x.computation_type.name], x.microbatch_index)
            for a in schedule.pipeline_order[r]
            if a is not None
            for x in (a.sub_actions or (a,))
        ]
        if mine != theirs:
            return False
    return True


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by its global name (a shared one once); zeros where none."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in global_named_parameters(model)
    }


def reference(cfg: Config, microbatches: list[Microbatch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process running the whole model (``cfg`` at pp = 1) over ``microbatches``: the losses
    and gradients by name."""
    stage = build_stage(cfg, ParallelGroups.single_process())
    losses = ptdp_step(stage, microbatches)
    return [x.item() for x in losses], named_grads(stage.model)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[bool, str, float]:
    """(equal under :data:`TOL`?, the first mismatch, the largest difference relative to the
    largest element) of two gradient dicts with the same names."""
    if set(a) != set(b):
        return False, f"different parameters: {sorted(set(a) ^ set(b))}", float("inf")
    worst, detail = 0.0, ""
    for name in a:
        scale = b[name].abs().max().clamp_min(1e-300)
        worst = max(worst, ((a[name] - b[name]).abs().max() / scale).item())
        if not detail:
            try:
                torch.testing.assert_close(a[name], b[name], **TOL[dtype])
            except AssertionError as e:
                detail = f"{name}: {e}"
    return not detail, detail, worst


def worker(args, kind: str, torch_name: str) -> dict:
    """One schedule at pp = ``args.pp``: the check step, then the timed steps. Rank 0's result."""
    groups = pc.init_pipeline(args.pp)
    try:
        return _run(args, groups, kind, torch_name)
    finally:
        torch.distributed.destroy_process_group()


def _run(args, groups: ParallelGroups, kind: str, torch_name: str) -> dict:
    cfg = gpt_config(args, kind, groups.pp.size)
    stage = build_stage(cfg, groups)
    tokens, labels = random_batch(cfg)
    microbatches = split(tokens, labels, cfg.train.micro_batch_size)
    row: dict = {"schedule": kind, "torch_schedule": torch_name}
    side = None
    try:
        side = torch_side(stage, torch_name)
    except Exception as e:
        row["torch_error"] = f"construction: {type(e).__name__}: {e}"
    ptdp_losses = ptdp_step(stage, microbatches)
    ptdp_grads = named_grads(stage.model)
    torch_losses, torch_grads = [], {}
    if side is not None:
        try:
            torch_losses = side.step(tokens, labels)
            torch_grads = named_grads(side.chunks)
        except Exception as e:
            row["torch_error"] = f"step: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    if side is not None:
        m = len(microbatches)
        row["same_compute_order"] = same_compute_order(side.schedule, kind, groups.pp.size, m)
    errors = [e for e in pc.all_gather_object(row.get("torch_error"), groups.world) if e]
    if errors:  # every rank learns before any further collective whether torch ran everywhere
        row["torch_error"], side = errors[0], None
    per_rank = pc.all_gather_object(
        ([x.item() for x in ptdp_losses], [x.item() for x in torch_losses], ptdp_grads, torch_grads), groups.world
    )
    if groups.world.rank == 0:
        row.update(_checks(cfg, args, per_rank, microbatches, side is not None))
    if side is None:  # a failed torch step may leave transfers posted: nothing is timed
        return row
    fns = {"ptdp": lambda: ptdp_step(stage, microbatches), "torch": lambda: side.step(tokens, labels)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(args.warmup + args.steps):
        order = list(fns.items()) if i % 2 == 0 else list(fns.items())[::-1]  # who goes first alternates
        for name, fn in order:
            elapsed = pc.timed_step(fn, groups.world)
            if i >= args.warmup:
                times[name].append(elapsed)
    row["median_step_s"] = {name: pc.median(t) for name, t in times.items()}
    row["min_step_s"] = {name: min(t) for name, t in times.items()}
    row["steps_s"] = times
    row["ratio_ptdp_over_torch"] = row["median_step_s"]["ptdp"] / row["median_step_s"]["torch"]
    # each iteration's two steps ran back to back: their ratio is the least disturbed by load changes
    row["median_paired_ratio"] = pc.median([a / b for a, b in zip(times["ptdp"], times["torch"])])
    return row


def _checks(cfg: Config, args, per_rank: list, microbatches: list[Microbatch], with_torch: bool) -> dict:
    """ptdp against one process and against torch: losses and gradients (rank 0, after the gather)."""
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    ptdp_losses = [x for rank in per_rank for x in rank[0]]
    ptdp_grads = {k: v for rank in per_rank for k, v in rank[2].items()}
    ref_losses, ref_grads = reference(gpt_config(args, "1f1b", 1), microbatches)
    ok, detail, worst = compare(ptdp_grads, ref_grads, dtype)
    out = {
        "mean_loss": sum(ptdp_losses) / len(ptdp_losses),
        "ptdp_vs_one_process": {
            "same": ok and _close(ptdp_losses, ref_losses, dtype),
            "max_rel_grad_diff": worst,
            "mismatch": detail,
        },
    }
    if with_torch:
        m = len(microbatches)
        torch_losses = [x for rank in per_rank for x in rank[1]]
        torch_grads = {k: v for rank in per_rank for k, v in rank[3].items()}
        ok, detail, worst = compare(ptdp_grads, torch_grads, dtype)
        ok_ref, detail_ref, worst_ref = compare(torch_grads, ref_grads, dtype)
        out["ptdp_vs_torch"] = {
            "same": ok and _close([x * (1.0 / m) for x in ptdp_losses], torch_losses, dtype),
            "max_rel_grad_diff": worst,
            "mismatch": detail,
        }
        out["torch_vs_one_process"] = {"same": ok_ref, "max_rel_grad_diff": worst_ref, "mismatch": detail_ref}
    return out


def _close(a: list[float], b: list[float], dtype: torch.dtype) -> bool:
    try:
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), **TOL[dtype]
        )
    except AssertionError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--steps", type=int, default=16, help="timed steps of each library per schedule")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=[k for k, _ in SCHEDULES], choices=[k for k, _ in SCHEDULES])
    args = ap.parse_args()

    start = time.perf_counter()
    names = dict(SCHEDULES)
    results = [pc.launch(worker, args.pp, args, kind, names[kind]) for kind in args.schedules]
    report = {
        "benchmark": "vs_torch_zero_bubble",
        "machine": pc.machine(),
        "args": vars(args),
        "results": results,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    rows = []
    for r in results:
        med = r.get("median_step_s", {})
        pt, ref = r.get("ptdp_vs_torch", {}), r["ptdp_vs_one_process"]
        rows.append(
            [
                args.pp,
                r["schedule"],
                r["torch_schedule"],
                f"{med['ptdp']:.3f}" if med else "-",
                f"{med['torch']:.3f}" if med else "-",
                f"**{r['ratio_ptdp_over_torch']:.3f}**" if "ratio_ptdp_over_torch" in r else "-",
                f"{r['median_paired_ratio']:.3f}" if "median_paired_ratio" in r else "-",
                f"{r['min_step_s']['ptdp'] / r['min_step_s']['torch']:.3f}" if "min_step_s" in r else "-",
                f"{pt['same']} ({pt['max_rel_grad_diff']:.1e})" if pt else "-",
                f"{ref['same']} ({ref['max_rel_grad_diff']:.1e})",
                r.get("same_compute_order", "-"),
                r.get("torch_error", "").splitlines()[0] if r.get("torch_error") else "",
            ]
        )
    print()
    headers = ["pp", "ptdp", "torch", "ptdp s/step", "torch s/step", "ptdp / torch", "median of paired ratios"]
    headers += ["ratio of minima"]
    headers += ["grads ptdp = torch (max rel diff)", "grads ptdp = one process (max rel diff)"]
    headers += ["same compute order", "torch error"]
    print(pc.table(headers, rows))
    checks = [r.get(key, {}).get("same") for r in results for key in ("ptdp_vs_torch", "ptdp_vs_one_process")]
    checks += [r.get("torch_vs_one_process", {}).get("same") for r in results]
    if any(c is False for c in checks):
        raise SystemExit("ptdp, torch.distributed.pipelining and one process computed different losses or gradients")


if __name__ == "__main__":
    main()
