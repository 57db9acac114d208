"""Data-parallel engine pieces in one process: bit packing, no_sync, the overlap misuse error,
the compression warmup defaults, the configuration rules and the fp16 hint (the collectives:
tests/dist/test_data_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.compression import packbits, unpackbits
from ptdp.engine.groups import ParallelGroups


def test_a_non_finite_gradient_norm_with_fp16_compression_points_to_bf16():
    from ptdp.engine.step import NONFINITE_GRAD_NORM, StepResult
    from ptdp.run.trainer import non_finite_step

    class Log:
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    result = StepResult(loss=2.0, grad_norm=float("inf"), lr=1e-3, skipped=True, skip_reason=NONFINITE_GRAD_NORM)
    for codec, hint in (("fp16", True), ("bf16", False), ("none", False)):
        log = Log()
        non_finite_step(result, 7, 1, 10, log, codec)
        assert ("--grad-compression fp16" in log.lines[0] and "65,504" in log.lines[0]) == hint, log.lines


def test_packbits_round_trip():
    bits = torch.rand(1003, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = packbits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 126
    assert torch.equal(unpackbits(packed, 1003), bits)


def test_no_sync_defers_every_reduction():
    groups = ParallelGroups.single_process()
    p = torch.nn.Parameter(torch.ones(4))
    p.ptdp_global = None
    buf = GradBuffer([[p]], dp=groups.dp, overlap=True)
    with buf.no_sync():
        (p * 2).sum().backward()
    assert all(b.finish is None for b in buf.buckets)
    torch.testing.assert_close(buf.grad(p), torch.full((4,), 2.0))


def test_grad_compression_warmup_defaults():
    def warmup(codec, iters=None):
        par = ParallelConfig(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            data_parallel_size=2,
            grad_compression=codec,
            grad_compression_warmup_iters=iters,
        )
        return resolve(Config(parallel=par, train=TrainConfig(lr_warmup_iters=30)), 2).grad_compression_warmup

    assert (warmup("none"), warmup("fp16"), warmup("bf16"), warmup("1bit")) == (0, 0, 0, 30)
    assert (warmup("1bit", 0), warmup("fp16", 5)) == (0, 5)
    with pytest.raises(ValueError, match="grad_compression_warmup_iters=5 has no effect with grad_compression=none"):
        warmup("none", 5)
    with pytest.raises(ValueError, match="grad_compression_warmup_iters=-1 must be an integer >= 0"):
        warmup("1bit", -1)


def test_overlap_without_no_sync_is_an_error_not_a_race():
    """A second backward into a bucket whose reduction already started raises (dp = 2 needed for
    a reduction to start; an axis of size 2 whose collectives never run stands in)."""
    from ptdp.engine.comm import AxisGroup, CommStats

    p = torch.nn.Parameter(torch.ones(4))
    _buffer = GradBuffer([[p]], dp=AxisGroup("dp", (0, 1), 0, None, CommStats()), overlap=True)  # its hooks act
    import ptdp.engine.data_parallel.buffer as buffer_module

    original = buffer_module.start_reduction
    buffer_module.start_reduction = lambda *a, **k: lambda: None
    try:
        (p * 2).sum().backward()  # last (synced) backward: the bucket starts
        with pytest.raises(RuntimeError, match="after its reduction started"):
            (p * 3).sum().backward()
    finally:
        buffer_module.start_reduction = original


def test_data_parallel_config_rules():
    base = dict(model=ModelConfig(), train=TrainConfig())
    with pytest.raises(
        ValueError,
        match="grad_compression=1bit cannot be combined with a sharded data-parallel state \\(use_distributed_optimizer;",
    ):
        resolve(
            Config(parallel=ParallelConfig(2, 2, grad_compression="1bit", use_distributed_optimizer=True), **base), 8
        )
    with pytest.raises(ValueError, match="grad_compression='2bit' must be one of"):
        resolve(Config(parallel=ParallelConfig(2, 2, grad_compression="2bit"), **base), 8)
    with pytest.raises(ValueError, match="overlap_param_gather needs use_distributed_optimizer"):
        resolve(Config(parallel=ParallelConfig(2, 2, overlap_param_gather=True), **base), 8)
    with pytest.raises(ValueError, match="ddp_bucket_size=0 must be a positive integer"):
        resolve(Config(parallel=ParallelConfig(2, 2, ddp_bucket_size=0), **base), 8)
    bf16 = dict(model=ModelConfig(params_dtype="bfloat16"), train=TrainConfig())
    assert resolve(
        Config(parallel=ParallelConfig(2, 2, grad_reduce_in_bf16=True), **bf16), 8
    ).parallel.grad_reduce_in_bf16
    with pytest.raises(
        ValueError, match="grad_reduce_in_bf16 \\(--grad-reduce-in-bf16\\) needs params_dtype=bfloat16, not float32"
    ):
        resolve(Config(parallel=ParallelConfig(2, 2, grad_reduce_in_bf16=True), **base), 8)
    with pytest.raises(
        ValueError, match="grad_reduce_in_bf16 reduces in bf16 already: grad_compression=fp16 must be none"
    ):
        resolve(Config(parallel=ParallelConfig(2, 2, grad_reduce_in_bf16=True, grad_compression="fp16"), **bf16), 8)
