"""Megatron's first/last pipeline stage layer counts (``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers``): the split they give, the errors before any process, and
``ptdp train`` / ``ptdp plan`` reading them from the same schema field."""

from __future__ import annotations

import pytest

from helpers.cli import tiny_flags
from ptdp import cli
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import (
    accounted_split,
    chunk_layer_ids,
    first_last_of,
    first_last_split,
    layer_split,
    stage_layer_counts,
    stage_layer_ids,
)


@pytest.mark.parametrize(
    "args, split",
    [
        ((126, 16, 7, 7), (7,) + (8,) * 14 + (7,)),  # Llama 3 405B at pp = 16
        ((8, 4, 1, 1), (1, 3, 3, 1)),
        ((7, 4, 1, None), (1, 2, 2, 2)),
        ((7, 4, None, 1), (2, 2, 2, 1)),
        ((5, 2, 3, None), (3, 2)),
        ((5, 2, None, 2), (3, 2)),
        ((5, 2, 1, 4), (1, 4)),
        ((9, 3, 2, 1), (2, 6, 1)),
    ],
)
def test_first_last_counts_give_this_split(args, split):
    assert first_last_split(*args) == split
    assert sum(split) == args[0] and len(split) == args[1]
    first, last = first_last_of(split)
    assert first_last_split(args[0], args[1], first, last) == split if (first, last) != (None, None) else True


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (126, 16, 7, 8),
            "decoder_first_pipeline_num_layers=7 and decoder_last_pipeline_num_layers=8 leave 126 - 15 = "
            "111 layers for the other 14 of pp=16 stages, which must split them evenly with at least one "
            "layer each (rule: (num_layers - first - last) % (pp - 2) == 0)",
        ),
        (
            (8, 4, 3, None),
            "decoder_first_pipeline_num_layers=3 leave 8 - 3 = 5 layers for the other 3 of pp=4 stages"
            ", which must split them evenly with at least one layer each (rule: (num_layers - first) % "
            "(pp - 1) == 0)",
        ),
        ((4, 4, 2, 1), "leave 4 - 3 = 1 layers for the other 2 of pp=4 stages"),
        (
            (5, 2, 2, 2),
            "decoder_first_pipeline_num_layers=2 and decoder_last_pipeline_num_layers=2 with pp=2: the two "
            "stages must hold all num_layers=5 layers (their sum is 4)",
        ),
        ((8, 1, 2, None), "decoder_first_pipeline_num_layers=2 needs pipeline_model_parallel_size >= 2, got 1"),
        ((8, 4, 0, None), "decoder_first_pipeline_num_layers=0: each must be an integer >= 1"),
    ],
)
def test_impossible_first_last_counts_name_the_numbers(args, message):
    with pytest.raises(ConfigError) as e:
        first_last_split(*args)
    assert message in str(e.value)


def test_explicit_split_excludes_first_last_counts():
    assert layer_split(8, 4, (2, 2, 2, 2)) == (2, 2, 2, 2) and layer_split(8, 4) is None
    assert layer_split(8, 4, None, 2, None) == (2, 2, 2, 2)
    with pytest.raises(
        ConfigError,
        match=r"pipeline_layer_split=\[2, 2, 2, 2\] lists every stage's layers; it "
        r"cannot be combined with decoder_last_pipeline_num_layers=2",
    ):
        layer_split(8, 4, (2, 2, 2, 2), None, 2)


def test_first_last_of_names_only_the_stages_that_differ():
    assert first_last_of((7,) + (8,) * 14 + (7,)) == (7, 7)
    assert first_last_of((8,) * 15 + (6,)) == (None, 6)
    assert first_last_of((6,) + (8,) * 15) == (6, None)
    assert first_last_of((4, 4, 4)) == (None, None) and first_last_of((3, 3)) == (None, None)
    assert first_last_of((3, 2)) == (3, None)
    assert first_last_of((1, 2, 3, 1)) is None  # middle stages differ: only --pipeline-layer-split says it


def _config(pp: int, num_layers: int, model: dict | None = None, **parallel) -> Config:
    model = ModelConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=303, **(model or {})
    )
    return Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, data_parallel_size=1, **parallel
        ),
        train=TrainConfig(micro_batch_size=1, global_batch_size=8),
    )


def test_resolve_keeps_the_counts_and_the_stages_hold_the_split():
    config = resolve(_config(4, 8, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1), 4)
    p = config.parallel
    assert (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == (1, 1)
    assert p.pipeline_layer_split is None and p.pipeline_split(8).layer_split == (1, 3, 3, 1)
    assert [list(stage_layer_ids(8, 4, r, p.pipeline_split(8).layer_split)) for r in range(4)] == [
        [0],
        [1, 2, 3],
        [4, 5, 6],
        [7],
    ]
    assert stage_layer_counts(8, 4, p.pipeline_split(8).layer_split) == [1, 3, 3, 1]
    assert resolve(config, 4) == config  # a resolved config (config.json) resolves again unchanged


@pytest.mark.parametrize(
    "parallel, message",
    [
        (
            dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=1),
            "leave 8 - 3 = 5 layers for the other 2 of pp=4 stages",
        ),
        (
            dict(decoder_first_pipeline_num_layers=2, pipeline_layer_split=(2, 2, 2, 2)),
            "cannot be combined with decoder_first_pipeline_num_layers=2",
        ),
        (dict(decoder_last_pipeline_num_layers=0), "decoder_last_pipeline_num_layers=0 must be a positive integer"),
        (
            dict(
                decoder_first_pipeline_num_layers=2,
                decoder_last_pipeline_num_layers=2,
                pipeline_schedule="interleaved-1f1b",
                num_layers_per_virtual_pipeline_stage=1,
            ),
            "decoder_first_pipeline_num_layers=2 / "
            "decoder_last_pipeline_num_layers=2 cannot be combined with virtual pipeline stages",
        ),
        (
            dict(
                decoder_first_pipeline_num_layers=1,
                decoder_last_pipeline_num_layers=1,
                model=dict(recompute_granularity="full", recompute_num_layers=2),
            ),
            "recompute_num_layers=2 is more than the 1 layers of the smallest model chunk (layers per chunk: [1, 3, 3, 1]",
        ),
    ],
)
def test_resolve_rejects_impossible_counts(parallel, message):
    with pytest.raises(ConfigError) as e:
        resolve(_config(4, 8, **parallel), 4)
    assert message in str(e.value)


def test_ptdp_train_refuses_both_kinds_of_split_before_any_worker(tmp_path, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr("ptdp.run.launch.launch_local", lambda *a, **k: launched.append(a) or {"error": "stub"})
    code = cli.main(
        [
            "train",
            *tiny_flags(num_layers=4, log_interval=None, eval_interval=None, no_progress=True),
            "--data-cache-dir",
            str(tmp_path / "cache"),
            "--tp",
            "1",
            "--pp",
            "2",
            "--dp",
            "1",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--pipeline-layer-split",
            "1,3",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not launched and "Traceback" not in err
    assert (
        "pipeline_layer_split=[1, 3] lists every stage's layers; it cannot be combined with "
        "decoder_first_pipeline_num_layers=1" in err
    )


def test_ptdp_plan_refuses_counts_that_do_not_split(capsys):
    code = cli.main(
        [
            "plan",
            "--model",
            "llama3-405b",
            "--gpus",
            "16384",
            "--gpu",
            "h100-sxm",
            "--global-batch-size",
            "2048",
            "--seq-length",
            "8192",
            "--tp",
            "8",
            "--pp",
            "16",
            "--decoder-first-pipeline-num-layers",
            "7",
            "--decoder-last-pipeline-num-layers",
            "8",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "leave 126 - 15 = 111 layers for the other 14 of pp=16 stages" in err


def test_embedding_and_loss_counted_as_layers():
    """Megatron's --account-for-embedding/loss-in-pipeline-split: Llama 3 405B's 126 layers + 2 in
    16 x 8 chunks of one unit: rank 0's first chunk holds only the embedding, rank 15's last only the
    output layer and loss."""
    assert accounted_split(126, 16, 8, embedding=True, loss=True) == (7,) + (8,) * 14 + (7,)
    assert accounted_split(126, 16, 1, embedding=True, loss=True) == (7,) + (8,) * 14 + (7,)
    assert accounted_split(7, 4, embedding=True, loss=False) == (1, 2, 2, 2)
    assert accounted_split(7, 4, embedding=False, loss=True) == (2, 2, 2, 1)
    assert chunk_layer_ids(126, 16, 8, 0, 0, embedding=True, loss=True) == range(0, 0)
    assert chunk_layer_ids(126, 16, 8, 15, 7, embedding=True, loss=True) == range(126, 126)
    assert [chunk_layer_ids(126, 16, 8, 0, c, embedding=True, loss=True) for c in (1, 7)] == [
        range(15, 16),
        range(111, 112),
    ]
    assert [chunk_layer_ids(8, 2, 2, r, c) for r in range(2) for c in range(2)] == [
        range(0, 2),
        range(4, 6),
        range(2, 4),
        range(6, 8),
    ]
    with pytest.raises(
        ConfigError,
        match=r"num_layers=126 \+ the embedding counted as layers = 127 is not "
        r"divisible by pp\*v = 16\*1 = 16",
    ):
        accounted_split(126, 16, embedding=True, loss=False)
    with pytest.raises(ConfigError, match=r"leaves a pipeline rank without layers \(layers per rank: \[0, 1, 1, 0\]"):
        accounted_split(2, 4, embedding=True, loss=True)
    with pytest.raises(ConfigError, match="cannot be combined with decoder_last_pipeline_num_layers=2"):
        layer_split(8, 4, None, None, 2, embedding=True)


def test_resolve_interleaves_with_the_embedding_and_loss_counted():
    config = resolve(
        _config(
            2,
            6,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
            num_layers_per_virtual_pipeline_stage=1,
            model=dict(recompute_granularity="full", recompute_num_layers=1),
        ),
        2,
    )
    p = config.parallel
    assert (
        p.schedule == "interleaved-1f1b"
        and p.pipeline_split(6).virtual_stages == 4
        and p.pipeline_split(6).layer_split == (3, 3)
    )
    # chunks of 0 layers (only the embedding / only the loss) do not limit recompute_num_layers
    with pytest.raises(
        ConfigError,
        match=r"num_layers=5 \+ 1 \(embedding/loss counted as layers\) = 6 is not "
        r"divisible by pp \* num_layers_per_virtual_pipeline_stage = 2\*2",
    ):
        resolve(_config(2, 5, account_for_loss_in_pipeline_split=True, num_layers_per_virtual_pipeline_stage=2), 2)


def test_train_flags_reach_the_config():
    from ptdp.config.flags import config_from_args

    args = cli.build_parser().parse_args(
        [
            "train",
            *tiny_flags(num_layers=8),
            "--tp",
            "1",
            "--pp",
            "4",
            "--dp",
            "2",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--decoder-last-pipeline-num-layers",
            "1",
        ]
    )
    p = resolve(config_from_args(args), 8).parallel
    assert p.pipeline_split(8).layer_split == (1, 3, 3, 1)
    args = cli.build_parser().parse_args(
        [
            "train",
            *tiny_flags(num_layers=6),
            "--tp",
            "1",
            "--pp",
            "2",
            "--dp",
            "1",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
        ]
    )
    p = resolve(config_from_args(args), 2).parallel
    assert (p.schedule, p.pipeline_split(6).virtual_stages, p.pipeline_split(6).layer_split) == (
        "interleaved-1f1b",
        2,
        (3, 3),
    )


def test_the_run_checks_and_reports_use_the_split():
    """ptdp train's memory check and planner report see the run's split: each rank's parameters
    with its own layers, and activations chunk by chunk when interleaved with the embedding and
    loss counted as layers (rank 1 keeps 5 layer-microbatches at its peak, not 2 x 5/3)."""
    from ptdp.planner.candidate import run_candidate
    from ptdp.planner.memory.activations import stage_activation_bytes
    from ptdp.planner.memory.params import stage_param_counts
    from ptdp.run.memory_check import rank_estimates

    config = resolve(_config(4, 8, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1), 4)
    assert run_candidate(config).layer_split == (1, 3, 3, 1)
    params = [r.params for r in rank_estimates(config)]
    counts = stage_param_counts(
        config.model,
        1,
        4,
        layer_split=(1, 3, 3, 1),
        make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
    )
    assert [x / params[1] for x in params] == pytest.approx([n / counts[1] for n in counts])
    assert counts[1] == counts[2] and counts[0] != counts[1]
    config = resolve(
        _config(
            2,
            4,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
            num_layers_per_virtual_pipeline_stage=1,
        ),
        2,
    )
    layout = run_candidate(config)
    assert (layout.virtual_stages, layout.layer_split) == (3, (2, 2))
    model = config.model
    per_mb = stage_activation_bytes(model, layout.replace(layer_split=None), 0, 1) / (7 / 3)
    estimates = rank_estimates(config)
    assert estimates[1].activations == pytest.approx(
        stage_activation_bytes(
            model, layout, 1, 2, make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by
        )
    )
    assert estimates[0].activations == pytest.approx(4 * per_mb)  # rank 0: chunks of 0, 1, 1 layers
