"""Property: the configuration validator and the planner agree on which layouts can run.

- Every request ``ptdp train`` could be given (model shape, tp, pp, dp, world size, micro and global
  batch, schedule, virtual stages, explicit layer split) is either refused by
  :func:`ptdp.config.resolve` with a :class:`ConfigError` within milliseconds and without starting
  any process, or accepted by it and by the planner evaluating that exact layout (memory may not
  fit; no rule may reject it).
- Conversely, every layout the planner's search lists is accepted by the validator.
- (tests/dist/test_config_property_dist.py: a fixed sample of accepted requests trains one step
  on gloo workers, with the loss of the single-process model.)

Hypothesis runs derandomized (the same examples every run; a failure prints the example).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptdp.config.fields import SCHEDULES
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.errors import ConfigError
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import gpt
from ptdp.planner.search.checks import check_model
from ptdp.planner.search.checks import check_request as check_plan_request
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.search.predict import evaluate
from ptdp.planner.splits import split_options

PROPERTY = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
GPU = CATALOG["h100-sxm"]
#: A refusal must come back this fast (seconds of this thread's CPU, so that a busy machine does
#: not count): it is pure arithmetic, no process, no I/O.
REFUSAL_BUDGET = 0.05


@contextlib.contextmanager
def no_processes():
    """Any attempt to start a process or a process group fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a process or process group was started while validating a configuration")

    with (
        mock.patch.object(subprocess.Popen, "__init__", forbidden),
        mock.patch("multiprocessing.process.BaseProcess.start", forbidden),
        mock.patch("torch.distributed.init_process_group", forbidden),
        mock.patch("ptdp.run.launch.launch_local", forbidden),
    ):
        yield


@st.composite
def requests(draw) -> tuple[Config, int]:
    """A ``ptdp train`` request: (unresolved config, world size). Each number is usually drawn to
    fit the others (heads a multiple of tp, layers of pp, ...) and sometimes anything, zero and
    negative included, so that every rule is both met and broken."""

    def fit(good, anything):  # 1 in 8: anything
        return draw(anything if draw(st.integers(0, 7)) == 0 else good)

    tp, pp = fit(st.sampled_from([1, 2, 4]), st.integers(-1, 8)), fit(st.sampled_from([1, 2, 3, 4]), st.integers(-1, 8))
    dp = fit(st.none() | st.sampled_from([1, 2, 3]), st.integers(-1, 4))
    pos_tp, pos_pp = max(tp, 1), max(pp, 1)
    heads = fit(st.integers(1, 4).map(lambda k: k * pos_tp), st.integers(-1, 12))
    per_chunk = fit(st.none() | st.integers(1, 3), st.integers(-1, 4))
    layers = fit(st.integers(1, 3).map(lambda k: k * pos_pp * max(per_chunk or 1, 1)), st.integers(-1, 12))
    model = ModelConfig(
        num_layers=layers,
        hidden_size=fit(st.integers(1, 8).map(lambda d: d * max(heads, 1)), st.integers(-1, 96)),
        num_attention_heads=heads,
        ffn_hidden_size=fit(st.none() | st.integers(1, 32).map(lambda k: k * pos_tp), st.integers(-1, 256)),
        seq_length=fit(st.integers(1, 64), st.integers(-1, 64)),
        vocab_size=draw(st.integers(250, 700)),
        num_query_groups=fit(
            st.none() | st.sampled_from([g for g in (1, 2, 4) if g % pos_tp == 0 and heads % g == 0] or [None]),
            st.integers(-1, 4),
        ),
        untie_embeddings_and_output_weights=draw(st.booleans()),
    )
    grid = pos_tp * pos_pp * (dp if dp and dp > 0 else draw(st.integers(1, 3)))
    world = fit(st.just(grid), st.integers(-1, 64))
    b = fit(st.integers(1, 4), st.integers(-1, 8))
    m = fit(st.integers(1, 4).map(lambda k: k * pos_pp), st.integers(1, 8))
    big_b = fit(st.just(max(b, 1) * (grid // (pos_tp * pos_pp)) * m), st.integers(-1, 64))
    split = None
    if per_chunk is None and draw(st.integers(0, 3)) == 0:  # an explicit split: pp positive parts of the layers
        anything = st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple)
        cuts = st.sets(st.integers(1, max(layers - 1, 1)), min_size=pos_pp - 1, max_size=pos_pp - 1)
        good = cuts.map(lambda c: tuple(b - a for a, b in zip([0, *sorted(c)], [*sorted(c), layers])))
        split = fit(good if pos_pp <= layers else anything, anything)
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        pipeline_layer_split=split,
        pipeline_schedule=fit(
            st.sampled_from([None, "interleaved-1f1b"] if per_chunk else [None, "1f1b", "gpipe"]),
            st.sampled_from(SCHEDULES),
        ),
        num_layers_per_virtual_pipeline_stage=per_chunk,
    )
    train = TrainConfig(micro_batch_size=b, global_batch_size=big_b, train_iters=1, lr_warmup_iters=0)
    return Config(model=model, parallel=parallel, train=train), world


def planner_view(config: Config) -> tuple[ModelConfig, Candidate]:
    """What ``ptdp plan`` evaluates for a resolved config: its model and its exact layout
    (gpipe and 1f1b are both v = 1 to the planner; precision fp32 as ptdp's float32)."""
    m, p, t = config.model, config.parallel, config.train
    model = gpt(
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        ffn_hidden_size=m.ffn,
        vocab_size=m.vocab_size,
        seq_length=m.seq_length,
    )
    layout = Candidate.of(
        p.tp,
        p.pp,
        p.dp,
        t.micro_batch_size,
        t.global_batch_size,
        config.pipeline.virtual_stages,
        precision="fp32",
        layer_split=p.pipeline_layer_split,
    )
    return model, layout


def check_request(config: Config, world: int) -> bool:
    """The property for one request; True if it was accepted."""
    start = time.thread_time()
    try:
        resolved = resolve(config, world)
    except ConfigError as e:
        elapsed = time.thread_time() - start
        assert elapsed < REFUSAL_BUDGET, f"refused after {elapsed * 1e3:.1f} ms: {e}"
        assert str(e).startswith("invalid configuration:\n  ")
        return False
    model, layout = planner_view(resolved)
    plan, rejection = evaluate(model, layout, Cluster(GPU, world, gpus_per_node=world))
    assert rejection is None or rejection.rule == "memory", (layout, plan.reasons)
    assert resolved.world_size == world and resolved.num_microbatches == layout.num_microbatches
    return True


def test_every_request_is_refused_quickly_or_accepted_by_the_planner_too():
    outcomes = []

    @PROPERTY
    @given(requests())
    def prop(request):
        outcomes.append(check_request(*request))

    with no_processes():
        prop()
    assert 0.05 * len(outcomes) < sum(outcomes) < 0.95 * len(outcomes), "both outcomes are exercised"


@st.composite
def planner_requests(draw) -> tuple[ModelConfig, int, int, Fixed]:
    """A ``ptdp plan`` request: a GPT (valid for :func:`check_model`), a GPU count, a global batch
    and the layout flags given (the others are searched)."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    groups = draw(st.none() | st.sampled_from([g for g in (1, 2, 3, 4, 8) if heads % g == 0]))
    model = gpt(
        draw(st.integers(1, 12)),
        heads * draw(st.integers(1, 16)),
        heads,
        ffn_hidden_size=draw(st.none() | st.integers(1, 256)),
        vocab_size=draw(st.integers(250, 700)),
        seq_length=draw(st.integers(1, 64)),
        num_query_groups=groups,
        untie_embeddings_and_output_weights=not draw(st.booleans()),
    )
    fixed = Fixed(
        tensor_model_parallel_size=draw(st.none() | st.sampled_from([1, 2, 4])),
        pipeline_model_parallel_size=draw(st.none() | st.sampled_from([1, 2, 3, 4])),
        micro_batch_size=draw(st.none() | st.sampled_from([1, 2, 4])),
        num_layers_per_virtual_pipeline_stage=draw(st.none() | st.integers(1, 3)),
    )
    return model, draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16])), draw(st.integers(1, 48)), fixed


def config_of(model: ModelConfig, layout: Candidate, fixed: Fixed) -> Config:
    """The ``ptdp train`` request with the flags of ``ptdp plan`` (``fixed``) for a layout it lists."""
    v = layout.virtual_stages
    per_chunk = fixed.num_layers_per_virtual_pipeline_stage or (model.num_layers // (layout.pp * v) if v > 1 else None)
    options = dict(split_options(layout.layer_split, v))  # the split's flags, as the report prints them
    options.setdefault("num_layers_per_virtual_pipeline_stage", per_chunk)
    return Config(
        model=ModelConfig(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            ffn_hidden_size=model.ffn,
            seq_length=model.seq_length,
            vocab_size=model.vocab_size,
            num_query_groups=model.num_query_groups,
            untie_embeddings_and_output_weights=not model.tied,
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            data_parallel_size=layout.dp,
            use_distributed_optimizer=layout.parallel.use_distributed_optimizer,
            pipeline_schedule=layout.parallel.schedule,
            **options,
        ),
        train=TrainConfig(
            micro_batch_size=layout.micro_batch_size,
            global_batch_size=layout.global_batch_size,
            train_iters=1,
            lr_warmup_iters=0,
        ),
    )


@PROPERTY
@given(planner_requests())
def test_every_layout_the_planner_lists_is_accepted_by_the_validator(request):
    model, gpus, big_b, fixed = request
    check_model(model)
    cluster = Cluster(GPU, gpus, gpus_per_node=gpus if gpus <= 8 else 4)
    try:
        check_plan_request(cluster, big_b, fixed, top=10, overhead_bytes=None)
    except ConfigError:
        return  # ptdp plan refuses the flags themselves
    result = search(model, cluster, big_b, fixed=fixed, precision="fp32")
    listed = result.plans + [plan for plan, rejection in result.rejected if rejection.rule == "memory"]
    for plan in listed:
        resolve(config_of(model, plan.layout, fixed), gpus)  # ConfigError: the planner listed a layout train refuses


def test_planner_keeps_the_interleaved_rules_of_the_virtual_stage_flag():
    """``--num-layers-per-virtual-pipeline-stage`` selects the interleaved schedule even when it
    gives one chunk per stage, so ``ptdp plan`` applies that schedule's rules as ``ptdp train`` does
    (found by the property above: the planner listed pp = 1 and m % pp != 0 layouts)."""
    model = gpt(4, 32, 4, vocab_size=300, seq_length=16)
    alone = search(model, Cluster(GPU, 1, gpus_per_node=1), 2, fixed=Fixed(num_layers_per_virtual_pipeline_stage=2))
    assert not alone.plans and "needs pipeline_model_parallel_size >= 2, got 1" in alone.rejected[0][0].reasons[0]
    odd = search(
        model,
        Cluster(GPU, 2, gpus_per_node=2),
        3,
        fixed=Fixed(pipeline_model_parallel_size=2, micro_batch_size=1, num_layers_per_virtual_pipeline_stage=2),
    )
    assert not odd.plans and "needs num_microbatches % pp == 0: num_microbatches=3" in odd.rejected[0][0].reasons[0]
    even = search(
        model,
        Cluster(GPU, 2, gpus_per_node=2),
        4,
        fixed=Fixed(pipeline_model_parallel_size=2, micro_batch_size=1, num_layers_per_virtual_pipeline_stage=2),
    )
    assert even.plans and {p.layout.virtual_stages for p in even.plans} == {1}
