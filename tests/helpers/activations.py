"""The planner's activation peak per rank against what ptdp's GPT really saves: the cases, the
measurement and the prediction (the method: tests/dist/test_planner_activations.py)."""

from __future__ import annotations

import functools

import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.fp8 import FP8Config
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.activation_meter import SavedActivationMeter, parameter_storages
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.layout.pipeline.partition import stage_layer_counts
from ptdp.planner.candidate import Candidate, run_candidate
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.cp_local import kv_buffer_bytes

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=500)
MICRO_BATCH, MICROBATCHES = 2, 4
DTYPES = ("float32", "float64")
#: the FP8 cases' dtypes: float32 or bfloat16 parameters with the layers' GEMMs in FP8
#: (``--fp8-format hybrid --fp8-recipe tensorwise``)
FP8_DTYPES = ("float32+fp8", "bfloat16+fp8")
FP8 = FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise")
TOLERANCE = 0.02
#: (tp, pp, dp, schedule) per world size; one job per world size runs all of its cases
CASES = {
    1: [(1, 1, 1, "1f1b"), (1, 1, 1, "gpipe")],
    2: [
        (2, 1, 1, "1f1b"),
        (1, 1, 2, "1f1b"),
        (1, 2, 1, "1f1b"),
        (1, 2, 1, "gpipe"),
        (1, 2, 1, "interleaved-1f1b"),
        (2, 1, 1, "1f1b", True),
        (1, 2, 1, "interleaved-1f1b", False, True),
        (1, 1, 1, "1f1b", False, False, 2),
    ],
    4: [
        (2, 2, 1, "1f1b"),
        (2, 2, 1, "interleaved-1f1b"),
        (1, 2, 2, "gpipe"),
        (2, 2, 1, "1f1b", True),
        (1, 2, 1, "1f1b", False, False, 2, "all_gather"),
        (2, 1, 1, "1f1b", True, False, 2),
    ],
}
"""A fifth entry True: with sequence parallelism; a sixth True: the embedding and the loss counted as
layers (4 + 2 units over 2 ranks x 3 chunks of one: rank 0 holds the embedding, layers 1 and 3;
rank 1 layers 0 and 2 and the loss); a seventh: the context-parallel size (its ranks hold s/cp
tokens of every activation), an eighth the key/value exchange (default p2p)."""
#: the cases run under :data:`FP8_DTYPES` (as :data:`CASES`, in the same job)
FP8_CASES = {2: [(2, 1, 1, "1f1b"), (2, 1, 1, "1f1b", True)]}


def jobs(world: int) -> list[tuple[tuple, tuple[str, ...]]]:
    """Each case of this world size with the dtypes it runs under."""
    return [(case, DTYPES) for case in CASES[world]] + [(case, FP8_DTYPES) for case in FP8_CASES.get(world, [])]


def case_config(
    tp: int,
    pp: int,
    dp: int,
    schedule: str,
    dtype: str,
    sequence_parallel: bool = False,
    accounted: bool = False,
    cp: int = 1,
    cp_comm_type: str = "p2p",
) -> Config:
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        cp_comm_type=cp_comm_type,
        pipeline_schedule=schedule,
        sequence_parallel=sequence_parallel,
        num_layers_per_virtual_pipeline_stage=1 if schedule == "interleaved-1f1b" else None,
        account_for_embedding_in_pipeline_split=accounted,
        account_for_loss_in_pipeline_split=accounted,
    )
    train = TrainConfig(
        micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICROBATCHES * dp, lr_warmup_iters=0
    )
    params_dtype, fp8 = dtype.removesuffix("+fp8"), dtype.endswith("+fp8")
    model = ModelConfig(**MODEL, params_dtype=params_dtype)
    config = Config(model=model, parallel=parallel, train=train, fp8=FP8 if fp8 else FP8Config())
    return resolve(config, tp * pp * dp * cp)


def measured_peak(cfg: Config, groups: ParallelGroups) -> int:
    """Peak bytes saved for backward during one train_step of this rank."""
    stage = build_stage(cfg, groups)
    gen = torch.Generator().manual_seed(groups.dp.rank)
    data = torch.randint(0, cfg.model.vocab_size, (MICROBATCHES, MICRO_BATCH, cfg.model.seq_length + 1), generator=gen)
    # each microbatch its own storage, so saved token ids never pin the whole batch
    microbatches = [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]
    meter = SavedActivationMeter(parameter_storages(stage.model))
    with meter.hooks():
        train_step(stage, microbatches, 0)
    return meter.peak


def predicted_peak(cfg: Config, pp_rank: int) -> float:
    """The planner's activation peak of ``pp_rank`` (fp32 figure, doubled for float64; with FP8
    the figure of the run's candidate, :func:`~ptdp.planner.candidate.run_candidate`): with
    cp > 1 that of one cp rank (:func:`~ptdp.planner.memory.activations.rank_activation_bytes`) without its
    key/value exchange buffers, which autograd does not save."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    split = cfg.pipeline.layer_split
    if cfg.fp8.enabled:
        fp8 = run_candidate(cfg)
        assert fp8 is not None
        layers = stage_layer_counts(m.num_layers, p.pp, split)[pp_rank]
        return rank_activation_bytes(
            m, fp8, pp_rank, layers, schedule="1f1b", make_vocab_size_divisible_by=m.make_vocab_size_divisible_by
        )
    layout = Candidate.of(
        p.tp,
        p.pp,
        p.dp,
        t.micro_batch_size,
        t.global_batch_size,
        virtual_stages=cfg.pipeline.virtual_stages,
        precision="fp32",
        sequence_parallel=p.sequence_parallel,
        layer_split=split,
        cp=p.cp,
        cp_comm_type=p.cp_comm_type,
    )
    schedule = "gpipe" if p.schedule == "gpipe" else "1f1b"
    layers = stage_layer_counts(m.num_layers, p.pp, split)[pp_rank]
    spec = m
    fp32 = rank_activation_bytes(
        spec,
        layout,
        pp_rank,
        layers,
        schedule=schedule,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
    ) - kv_buffer_bytes(spec, p.tp, p.cp, t.micro_batch_size, p.cp_comm_type, 4.0)
    return {"float32": 1, "float64": 2}[m.params_dtype] * fp32


def _run_cases(groups_for, cases) -> list[dict]:
    out = []
    for (tp, pp, dp, schedule, *sp), dtypes in cases:
        groups = groups_for(tp, pp, dp, sp[2] if len(sp) > 2 else 1)
        c = groups.coords
        for dtype in dtypes:
            case = (tp, pp, dp, schedule, dtype, *sp)
            out.append(
                {
                    "case": case,
                    "coords": (c.tp_rank, c.pp_rank, c.dp_rank),
                    "measured": measured_peak(case_config(*case), groups),
                }
            )
    return out


def _worker(rank: int, world: int, cases) -> list[dict]:
    return _run_cases(
        lambda tp, pp, dp, cp: ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT), cases
    )


@functools.cache
def measurements(world: int) -> list[dict]:
    """Every rank's records for the cases of this world size (world 1 runs in this process)."""
    if world == 1:
        return _run_cases(lambda tp, pp, dp, cp: ParallelGroups.single_process(), jobs(1))
    return [row for rows in run_in_pool(_worker, world, jobs(world)) for row in rows]


def compared(world: int) -> list[dict]:
    rows = []
    for r in measurements(world):
        predicted = predicted_peak(case_config(*r["case"]), r["coords"][1])
        rows.append({**r, "predicted": predicted, "error": r["measured"] / predicted - 1})
    return rows


def _table(rows: list[dict]) -> str:
    return "\n".join(
        f"{r['case']} (tp, pp, dp rank) {r['coords']}: measured {r['measured']:,} B, "
        f"predicted {r['predicted']:,.0f} B, {100 * r['error']:+.2f}%"
        for r in rows
    )
