"""Invariant 4: invalid configurations raise ConfigError naming the values and the rule, before any
process or process group exists."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

import ptdp.train as train_module
from ptdp import cli
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.errors import ConfigError
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import run_candidate


def make(world=8, tp=2, pp=2, dp=None, split=None, schedule=None, per_chunk=None, sp=False, **kw) -> tuple[Config, int]:
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in kw.items() if k in model_keys})
    train = TrainConfig(**{k: v for k, v in kw.items() if k not in model_keys})
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        pipeline_layer_split=split,
        pipeline_schedule=schedule,
        num_layers_per_virtual_pipeline_stage=per_chunk,
        sequence_parallel=sp,
    )
    return Config(model=model, parallel=par, train=train), world


BAD = [
    (dict(world=8, tp=2, pp=2, dp=3), r"world_size=8 != tp\*pp\*dp = 2\*2\*3 = 12"),
    (dict(world=8, tp=2, pp=2, dp=0), r"data_parallel_size=0 must be a positive integer"),
    (dict(world=6, tp=4, pp=1), r"world_size=6 is not divisible by tp\*pp=4\*1=4"),
    (
        dict(num_attention_heads=6, hidden_size=120, tp=4, pp=1),
        r"num_attention_heads=6 is not divisible by tensor_model_parallel_size=4",
    ),
    (
        dict(hidden_size=130, num_attention_heads=4, tp=1, pp=1),
        r"hidden_size=130 is not divisible by num_attention_heads=4",
    ),
    (dict(ffn_hidden_size=126, tp=4, pp=1), r"ffn_hidden_size=126 is not divisible by tensor_model_parallel_size=4"),
    (dict(num_layers=5, tp=2, pp=2), r"num_layers=5 is not divisible by pipeline_model_parallel_size=2"),
    (
        dict(num_layers=5, pp=2, split=(3, 3)),
        r"pipeline_layer_split=\[3, 3\] must have pp=2 entries, each >= 1, summing to num_layers=5",
    ),
    (dict(num_layers=4, pp=2, split=(4, 0)), r"pipeline_layer_split=\[4, 0\]"),
    (dict(num_layers=4, pp=2, split=(1, 1, 2)), r"pipeline_layer_split=\[1, 1, 2\] must have pp=2 entries"),
    (
        dict(global_batch_size=30, micro_batch_size=4),
        r"global_batch_size=30 is not divisible by micro_batch_size\*dp = 4\*2 = 8",
    ),
    (dict(vocab_size=100), r"vocab_size=100 must be >= 258"),
    (dict(params_dtype="int8"), r"params_dtype='int8' must be one of"),
    (dict(lr=0.0), r"lr=0.0 must be > 0"),
    (dict(min_lr=1.0, lr=0.1), r"min_lr=1.0 must be in \[0, lr=0.1\]"),
    (dict(lr_warmup_iters=50, train_iters=10), r"lr_warmup_iters=50 must be in \[0, lr_decay_iters=10\]"),
    (dict(lr_warmup_iters=-1), r"lr_warmup_iters=-1 must be in \[0, lr_decay_iters=300\]"),
    (dict(lr_warmup_fraction=1.5), r"lr_warmup_fraction=1.5 must be in \[0, 1\]"),
    (dict(lr_warmup_fraction=-0.1, lr_warmup_iters=3), r"lr_warmup_fraction=-0.1 must be in \[0, 1\]"),
    (dict(clip_grad=-1.0), r"clip_grad=-1.0 must be >= 0"),
    (dict(tp=0), r"tensor_model_parallel_size=0 must be a positive integer"),
    (dict(micro_batch_size=0), r"micro_batch_size=0 must be a positive integer"),
    (dict(seq_length=-1), r"seq_length=-1 must be a positive integer"),
    (dict(lr=float("inf")), r"lr=inf must be a finite number"),
    (dict(clip_grad=float("nan")), r"clip_grad=nan must be a finite number"),
    (dict(init_method_std=float("nan")), r"init_method_std=nan must be a finite number"),
    (dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*63\)"),
    (
        dict(per_chunk=1, global_batch_size=8, micro_batch_size=4, pp=4, tp=1, world=8),
        r"interleaved-1f1b schedule needs num_microbatches % pp == 0: num_microbatches=1 .* pp=4",
    ),
    (
        dict(per_chunk=1, global_batch_size=24, micro_batch_size=4),
        r"interleaved-1f1b schedule needs num_microbatches % pp == 0: num_microbatches=3",
    ),
    (
        dict(per_chunk=3, num_layers=8),
        r"num_layers=8 is not divisible by pp \* num_layers_per_virtual_pipeline_stage = 2\*3 = 6",
    ),
    (
        dict(per_chunk=1, pp=1, tp=2, world=8),
        r"interleaved-1f1b schedule needs pipeline_model_parallel_size >= 2, got 1",
    ),
    (dict(schedule="interleaved-1f1b"), r"interleaved-1f1b schedule needs num_layers_per_virtual_pipeline_stage"),
    (
        dict(schedule="gpipe", per_chunk=1),
        r"num_layers_per_virtual_pipeline_stage needs the interleaved-1f1b schedule, not gpipe",
    ),
    (dict(schedule="zero-bubble"), r"pipeline_schedule='zero-bubble' must be one of"),
    (dict(schedule="auto"), r"--pipeline-schedule auto: ptdp train does not run it yet"),
    (dict(schedule="zb-h2", per_chunk=1), r"num_layers_per_virtual_pipeline_stage needs the interleaved-1f1b"),
    (
        dict(schedule="zb-v", per_chunk=2),
        r"the zb-v schedule runs two model chunks per rank in a V: virtual_pipeline_model_parallel_size must be 2, "
        r"got 1",
    ),
    (
        dict(schedule="zb-v", num_layers=6),
        r"num_layers=6 is not divisible by 2 \* pp = 4 \(the zb-v schedule's two model chunks per rank\)",
    ),
    (
        dict(schedule="dualpipev", global_batch_size=12, micro_batch_size=2),
        r"the dualpipev schedule needs num_microbatches >= 2 \* pp: num_microbatches=3 .* pp=2",
    ),
    (dict(sp=True, tp=1, world=4), r"sequence_parallel needs tensor_model_parallel_size > 1, got 1"),
    (
        dict(sp=True, tp=4, pp=1, seq_length=130),
        r"seq_length=130 is not divisible by tensor_model_parallel_size=4 "
        r"\(rule: s % tp == 0 with sequence_parallel",
    ),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_rule_raises_config_error(kwargs, message):
    cfg, world = make(**kwargs)
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world)
    assert issubclass(ConfigError, ValueError)


def test_all_broken_rules_reported_together():
    cfg, world = make(num_attention_heads=6, hidden_size=120, ffn_hidden_size=126, tp=4, pp=2, world=8, num_layers=3)
    with pytest.raises(ConfigError) as info:
        resolve(cfg, world)
    text = str(info.value)
    assert "num_attention_heads=6" in text and "ffn_hidden_size=126" in text and "num_layers=3" in text


def test_valid_config_resolves_dp_and_microbatches():
    cfg, world = make(world=8, tp=2, pp=2, global_batch_size=32, micro_batch_size=4)
    resolved = resolve(cfg, world)
    assert resolved.parallel.dp == 2 and resolved.num_microbatches == 4
    assert resolved.model.ffn_hidden_size == 4 * resolved.model.hidden_size
    assert resolved.train.lr_decay_iters is None and resolved.train.decay_iters == resolved.train.train_iters
    uneven, _ = make(world=2, tp=1, pp=2, num_layers=5, split=(3, 2), global_batch_size=8, micro_batch_size=2)
    assert resolve(uneven, 2).parallel.pipeline_layer_split == (3, 2)


def test_vocab_padding_rule():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(303, 8, 4) == 320


def test_config_json_round_trip():
    cfg, world = make(world=2, tp=1, pp=2, num_layers=5, split=(3, 2))
    resolved = resolve(cfg, world)
    assert Config.from_dict(resolved.to_dict()) == resolved


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if anything tries to start workers or a process group."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a worker or process group was started for an invalid config")

    monkeypatch.setattr("ptdp.run.launch.launch_local", forbidden)
    monkeypatch.setattr("ptdp.run.rundir.prepare", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)


def test_sequence_parallel_resolves_at_tp_above_one():
    resolved = resolve(make(sp=True, seq_length=128)[0], 8)
    assert resolved.parallel.sequence_parallel and resolved.parallel.tp == 2
    assert Config.from_dict(resolved.to_dict()) == resolved
    assert run_candidate(resolved).parallel.sequence_parallel  # the planner comparison at the end of ptdp train


def test_virtual_stages_imply_interleaving():
    cfg, world = make(per_chunk=1)
    resolved = resolve(cfg, world)
    assert resolved.parallel.pipeline_schedule == "interleaved-1f1b"
    assert resolved.pipeline.virtual_stages == 2
    assert resolve(make()[0], 8).parallel.pipeline_schedule == "1f1b"


def test_virtual_pipeline_size_is_the_same_run_as_layers_per_chunk():
    """--virtual-pipeline-model-parallel-size v places the layers as --num-layers-per-virtual-pipeline-stage
    L / (pp v) does; both given must agree; v must split the layers evenly."""
    by_chunk = resolve(make(per_chunk=1)[0], 8)
    cfg, world = make()
    by_v = resolve(
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, virtual_pipeline_model_parallel_size=2)),
        world,
    )
    assert by_v.parallel.pipeline_schedule == "interleaved-1f1b"
    assert by_v.pipeline == by_chunk.pipeline
    assert [list(by_v.pipeline.chunk_layer_ids(r, c)) for r in range(2) for c in range(2)] == [[0], [2], [1], [3]]
    both = dataclasses.replace(
        cfg.parallel, virtual_pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1
    )
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=4 contradicts num_layers_per_virtual"):
        resolve(dataclasses.replace(cfg, parallel=both), world)
    three = dataclasses.replace(cfg.parallel, virtual_pipeline_model_parallel_size=3)
    with pytest.raises(ConfigError, match=r"num_layers=4 is not divisible by pp\*v = 2\*3 = 6"):
        resolve(dataclasses.replace(cfg, parallel=three), world)


def test_v_schedules_split_the_layers_in_a_v():
    """zb-v and dualpipev take two chunks per rank (given or implied); rank 0 holds the first and the last."""
    for v in (None, 2):
        par = dataclasses.replace(make(schedule="zb-v")[0].parallel, virtual_pipeline_model_parallel_size=v)
        split = par.pipeline_split(8)
        assert (split.virtual_stages, split.placement) == (2, "v")
        assert [list(split.chunk_layer_ids(0, c)) for c in range(2)] == [[0, 1], [6, 7]]
    cfg, world = make(schedule="dualpipev", global_batch_size=16, micro_batch_size=2)
    resolved = resolve(cfg, world)
    assert (resolved.pipeline.virtual_stages, resolved.pipeline.placement) == (2, "v")


CLI_BAD = [
    (["--tp", "3"], "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"),
    (["--dp", "3"], "global_batch_size=32 is not divisible by micro_batch_size*dp = 4*3 = 12"),
    (["--nproc-per-node", "6"], "world_size=6 is not divisible by tp*pp=2*2=4"),
    (["--num-layers", "3"], "num_layers=3 is not divisible by pipeline_model_parallel_size=2"),
    (["--ffn-hidden-size", "511"], "ffn_hidden_size=511 is not divisible by tensor_model_parallel_size=2"),
    (
        ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "24"],
        "interleaved-1f1b schedule needs num_microbatches % pp == 0: num_microbatches=3",
    ),
    (
        ["--num-layers-per-virtual-pipeline-stage", "3"],
        "num_layers=4 is not divisible by pp * num_layers_per_virtual_pipeline_stage",
    ),
    (["--sequence-parallel", "--tp", "1"], "sequence_parallel needs tensor_model_parallel_size > 1, got 1"),
    (["--pipeline-schedule", "auto"], "--pipeline-schedule auto: ptdp train does not run it yet"),
    (
        ["--pipeline-schedule", "zb-v", "--data-parallel-sharding-strategy", "optim_grads_params"],
        "--pipeline-schedule zb-v with --data-parallel-sharding-strategy optim_grads_params and tied embeddings",
    ),
]


@pytest.mark.parametrize("argv,message", CLI_BAD)
def test_cli_rejects_before_any_worker(argv, message, no_workers, capsys, tmp_path):
    code = cli.main(["train", "--output-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), "no run directory for a rejected config"


def test_torchrun_entry_rejects_before_process_group(no_workers, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    code = train_module.main(["--tp", "2", "--pp", "2", "--num-attention-heads", "3", "--hidden-size", "96"])
    assert code == 2
    assert "num_attention_heads=3 is not divisible by tensor_model_parallel_size=2" in capsys.readouterr().err
