"""ptdp trains exactly on a torch without ``dist.all_gather_single`` and ``dist.reduce_scatter_single``
(names newer than the ``torch`` floor of pyproject.toml): in workers where both are removed,
tensor parallelism with sequence parallelism and the distributed optimizer, ZeRO-2 and ZeRO-3
(``optim_grads``, ``optim_grads_params``) and context parallelism (the all-gather key/value exchange;
ZeRO-3 over dp x cp) equal one process (float64, 1e-9), through ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, which must have been called."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from helpers import cp_cases, layout_cases, zero_cases
from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import TOL, full_parameters, real_rows, train_and_collect
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

NEWER = ("all_gather_single", "reduce_scatter_single")
OLDER = ("all_gather_into_tensor", "reduce_scatter_tensor")

#: (tp, cp, pp, dp) -> [(source of the case, variant)], all at world 4
CASES = {
    (2, 1, 1, 2): [("layout", "sp_distopt"), ("zero", "grads_sp"), ("zero", "params_sp")],
    (1, 2, 1, 2): [("cp", "llama_all_gather"), ("zero_cp", "params")],
}


@contextlib.contextmanager
def without_newer_collectives():
    """``torch.distributed`` as an older torch has it: the newer names removed, the older ones
    counted (calls per name); everything restored after."""
    saved = {name: getattr(dist, name) for name in NEWER if hasattr(dist, name)}
    older = {name: getattr(dist, name) for name in OLDER}
    calls = dict.fromkeys(OLDER, 0)

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return older[name](*args, **kwargs)

        return call

    try:
        for name in saved:
            delattr(dist, name)
        for name in OLDER:
            setattr(dist, name, counted(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the older names are deprecated where both exist
            yield calls
    finally:
        for name, fn in {**saved, **older}.items():
            setattr(dist, name, fn)


def config(source: str, name: str, layout: tuple[int, int, int, int]):
    tp, cp, pp, dp = layout
    if source == "layout":
        return layout_cases.variant_config(name, tp, pp, dp)
    if source == "zero":
        return zero_cases.zero_config(name, tp, pp, dp)
    if source == "zero_cp":  # ZeRO-3 sharded over dp x cp
        return zero_cases.cp_config(name)
    return cp_cases.cp_config(name, tp, cp, pp, dp)


def reference(source: str, name: str) -> dict:
    refs = {"layout": layout_cases.reference, "zero": zero_cases.reference, "zero_cp": zero_cases.reference}
    return refs.get(source, cp_cases.reference)(name)


def floor_worker(rank: int, world: int) -> dict:
    out = {}
    with without_newer_collectives() as calls:
        assert not any(hasattr(dist, name) for name in NEWER)
        for layout, cases in CASES.items():
            tp, cp, pp, dp = layout
            groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
            for source, name in cases:
                before = dict(calls)
                res = train_and_collect(config(source, name, layout), groups)
                res["older_calls"] = {k: calls[k] - before[k] for k in calls}
                out[(layout, name)] = res
    return out


def test_parallel_axes_train_exactly_without_the_newer_collectives():
    results = run_in_pool(floor_worker, 4)
    for layout, cases in CASES.items():
        for source, name in cases:
            runs = [{name: res[(layout, name)]} for res in results]
            assert all(sum(run[name]["older_calls"].values()) > 0 for run in runs), (layout, name)
            ref = reference(source, name)
            assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
            for run in runs:
                got = run[name]
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
                torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
            params = full_parameters(runs, name)
            want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
            assert sorted(params) == sorted(want)
            for key in want:
                torch.testing.assert_close(
                    params[key], want[key], **TOL["float64"], msg=lambda m, k=key: f"{name} {k}: {m}"
                )
    # the sharded strategies gather and reduce-scatter through the older names on every rank
    for res in results:
        zero3 = res[((2, 1, 1, 2), "params_sp")]["older_calls"]
        assert zero3["all_gather_into_tensor"] > 0 and zero3["reduce_scatter_tensor"] > 0
