"""Host synchronisations of an expert-parallel step (ep 2 over dp 2, 4 MoE layers, 2 micro-batches
per rank): dropless, each MoE layer reads its splits once per micro-batch (one counts exchange,
with either dispatcher); with expert inputs padded to the capacity every split is known and a step
that is not logged synchronises nothing."""

from __future__ import annotations

import tempfile
from pathlib import Path

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.host_sync import label_check_on_device
from helpers.sync_cases import counted_run, logged
from ptdp.config.moe import MoEConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

DROPLESS = MoEConfig(num_experts=4, moe_aux_loss_coeff=0.01)
PADDED = MoEConfig(num_experts=4, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
#: name -> (MoE options, dispatcher, synchronisations per step in the MoE layers)
RUNS = {
    "alltoall": (DROPLESS, "alltoall", 4 * 2),
    "allgather": (DROPLESS, "allgather", 4 * 2),
    "alltoall_padded": (PADDED, "alltoall", 0),
    "allgather_padded": (PADDED, "allgather", 0),
}


def sync_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(dp=2), PG_TIMEOUT, ep=2)
    out = {}
    with tempfile.TemporaryDirectory() as tmp, label_check_on_device():
        for name, (moe, dispatcher, _) in RUNS.items():
            out[name] = counted_run(
                groups,
                1,
                1,
                2,
                Path(tmp) / name,
                moe=moe,
                expert_model_parallel_size=2,
                moe_token_dispatcher_type=dispatcher,
            )
    return out


def test_expert_parallel_steps_synchronise_once_per_layer_and_micro_batch_or_never_when_padded():
    results = run_in_pool(sync_worker, 2)
    for name, (_, _, per_step) in RUNS.items():
        for rank, res in enumerate(results):
            for iteration, calls in res[name]["per_step"].items():
                if iteration == 1:
                    continue
                moe_calls = [c for c in calls if "layer.py" in c]
                assert len(moe_calls) == per_step, (name, rank, iteration, calls)
                assert len(calls) - len(moe_calls) == (1 if logged(iteration) else 0), (name, rank, iteration, calls)
        assert len({res[name]["final_loss"] for res in results}) == 1, name
