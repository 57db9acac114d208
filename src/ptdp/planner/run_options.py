"""What a run does that ``ptdp train`` does not, from ``ptdp plan``'s planner-only flags, as the
:class:`~ptdp.planner.time.constants.PerfConstants` that time it, with a note naming each: the
communication overlap (TP comm-GEMM or asynchronous TP, pipeline transfers, the MoE all-to-alls),
Megatron-Core's flex dispatcher, PyTorch's context parallelism and CUDA graphs, each checked by
the rules Megatron-Core holds them to (``ConfigError``).
"""

from __future__ import annotations

import argparse
import dataclasses

from ptdp.config.model import ModelConfig
from ptdp.errors import ConfigError
from ptdp.planner.inputs.moe_model import moe_of
from ptdp.planner.search.layouts import Fixed
from ptdp.planner.time.constants import PerfConstants


def run_option_constants(
    args: argparse.Namespace, constants: PerfConstants, model: ModelConfig, fixed: Fixed, gpu
) -> tuple[PerfConstants, list[str]]:
    """``constants`` with the run's overlap (:func:`overlap_constants`) and CUDA graphs
    (:func:`graph_constants`), and the notes naming them."""
    constants, notes = overlap_constants(args, constants, fixed)
    constants, graph_notes = graph_constants(args, constants, model, fixed, gpu)
    return constants, notes + graph_notes


def overlap_constants(args: argparse.Namespace, constants, fixed: Fixed):
    """``constants`` with the communication overlap the run uses, and a note naming it:
    the data-parallel reduction during the last microbatch's backward with ``--overlap-grad-reduce``
    (ptdp's default, :attr:`~ptdp.planner.time.constants.PerfConstants.overlap_window`),
    ``--tp-comm-overlap`` and ``--overlap-p2p-communication`` (planner only). ConfigError for
    ``--tp-comm-overlap`` with ``--no-sequence-parallel`` (the overlap splits sequence
    parallelism's collectives; Megatron refuses it too)."""
    tp_overlap = bool(getattr(args, "tp_comm_overlap", None))
    async_tp = bool(getattr(args, "enable_async_tensor_parallel", None))
    pp_overlap = bool(getattr(args, "overlap_p2p_communication", None))
    if tp_overlap and async_tp:
        raise ConfigError(
            "--tp-comm-overlap (Transformer Engine's) and --enable-async-tensor-parallel (PyTorch's) are "
            "two implementations of one overlap: give one"
        )
    for flag, on in (("--tp-comm-overlap", tp_overlap), ("--enable-async-tensor-parallel", async_tp)):
        if on and fixed.sequence_parallel is False:
            raise ConfigError(
                f"{flag} needs sequence parallelism (it overlaps the sequence-parallel all-gather "
                "and reduce-scatter with the GEMMs): drop --no-sequence-parallel"
            )
    constants = constants.with_overlap(
        overlap_grad_reduce=fixed.overlap_grad_reduce is not False,
        tp_comm_overlap=tp_overlap,
        pp_overlap=pp_overlap,
        async_tp=async_tp,
    )
    if getattr(args, "delay_wgrad_compute", None) and not getattr(args, "overlap_moe_expert_parallel_comm", None):
        raise ConfigError(
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (its weight gradients run "
            "after that overlap's exchanges)"
        )
    if getattr(args, "overlap_moe_expert_parallel_comm", None):
        constants = dataclasses.replace(constants, moe_overlap=True)
    flex = getattr(args, "moe_flex_dispatcher_backend", None)
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if flex and dispatcher not in (None, "flex"):
        raise ConfigError(
            f"--moe-flex-dispatcher-backend {flex} is the backend of --moe-token-dispatcher-type flex, not {dispatcher}"
        )
    if dispatcher == "flex":
        flex = flex or "deepep"
    if flex:
        constants = dataclasses.replace(constants, moe_flex_dispatcher=flex)
    torch_cp = getattr(args, "cp_implementation", None) == "torch"
    if torch_cp:
        constants = dataclasses.replace(constants, cp_implementation="torch")
    hidden = [
        name
        for name, on in (
            (
                "tensor-parallel communication behind the GEMMs with sequence parallelism (--tp-comm-overlap)",
                tp_overlap,
            ),
            (
                "the forward pass's tensor-parallel communication behind its GEMMs (--enable-async-tensor-parallel)",
                async_tp,
            ),
            ("the interleaved schedule's pipeline transfers (--overlap-p2p-communication)", pp_overlap),
            (
                "the MoE all-to-alls behind another micro-batch's compute (--overlap-moe-expert-parallel-comm"
                + (", with --delay-wgrad-compute" if getattr(args, "delay_wgrad_compute", None) else "")
                + ")",
                bool(getattr(args, "overlap_moe_expert_parallel_comm", None)),
            ),
            (
                f"the flex token dispatcher with {flex} (--moe-token-dispatcher-type flex)",
                bool(flex),
            ),
        )
        if on
    ]
    notes = [f"planned as the run does, which ptdp train does not: {'; '.join(hidden)}"] if hidden else []
    if torch_cp:
        notes.append(
            "context parallelism planned as PyTorch's experimental context_parallel runs it "
            "(--cp-implementation torch): its float32 merge and gradient traffic added"
        )
    return constants, notes


#: The ``--cuda-graph-scope`` values whose graphs hold the MoE layers' router
MOE_GRAPH_SCOPES = ("full_iteration", "moe", "moe_router", "moe_preprocess")


def cuda_graph_choice(args: argparse.Namespace) -> tuple[str, str]:
    """(the flag, the CUDA graph implementation it names): ``--cuda-graph-impl``, or Megatron-Core's
    older ``--enable-cuda-graph`` / ``--external-cuda-graph``; ("", "none") without them.
    ConfigError when two are given."""
    given = [
        (flag, impl)
        for flag, impl in (
            (f"--cuda-graph-impl {getattr(args, 'cuda_graph_impl', None)}", getattr(args, "cuda_graph_impl", None)),
            ("--enable-cuda-graph", "local" if getattr(args, "enable_cuda_graph", None) else None),
            ("--external-cuda-graph", "transformer_engine" if getattr(args, "external_cuda_graph", None) else None),
        )
        if impl is not None
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(flag for flag, _ in given)} both name the CUDA graph implementation: give one"
        )
    return given[0] if given else ("", "none")


def cuda_graph_scope(
    named: str, impl: str, scope: list[str], model: ModelConfig, fixed: Fixed, flex: bool
) -> list[str]:
    """The scope the run captures (``transformer_engine`` without one: the attention with the MLP
    and/or MoE layers the model has, as Megatron-Core defaults it), checked by Megatron-Core's
    rules (``named``: the flag that names ``impl``): ConfigError for a scope without an
    implementation, full recompute, ``local`` with a scope other than ``full_iteration``,
    ``full_iteration`` with ``transformer_engine``, ``moe`` with ``moe_router``, ``moe_preprocess``
    without ``moe_router``, an MoE scope on a dense model, ``mlp`` without a dense layer, ``moe``
    but with the alltoall dispatcher dropping and padding to a capacity, ``moe_preprocess`` with a
    capacity (its host synchronisation)."""
    if impl == "none":
        if scope:
            raise ConfigError(
                f"--cuda-graph-scope {' '.join(scope)} needs --cuda-graph-impl local or transformer_engine "
                "(the implementation that captures the graphs)"
            )
        return []
    if fixed.recompute_granularity == "full":
        raise ConfigError(f"{named} needs --recompute-granularity selective or none: no graphs with full recompute")
    if impl == "local":
        if scope and scope != ["full_iteration"]:
            raise ConfigError(
                f"{named} captures whole layers, or with --cuda-graph-scope full_iteration the iteration, "
                f"not {' '.join(scope)} (the other scopes are transformer_engine's)"
            )
        return scope
    if "full_iteration" in scope:
        raise ConfigError(f"--cuda-graph-scope full_iteration needs --cuda-graph-impl local, not {impl}")
    moe = moe_of(model)
    layers = moe.moe_layers(model.num_layers) if moe is not None else (False,) * model.num_layers
    captured = f"{named} --cuda-graph-scope {' '.join(scope)}"
    if not scope:
        scope = ["attn"] + (["mlp"] if not all(layers) else []) + (["moe"] if any(layers) else [])
        captured = f"{named} without --cuda-graph-scope (capturing {' '.join(scope)}, Megatron-Core's default)"
    broken = []
    if "moe" in scope and "moe_router" in scope:
        broken.append("moe and moe_router are two captures of one router: give one")
    if "moe_preprocess" in scope and "moe_router" not in scope:
        broken.append("moe_preprocess is captured with moe_router only")
    if moe is None and {"moe", "moe_router", "moe_preprocess"} & set(scope):
        broken.append("moe, moe_router and moe_preprocess need a mixture-of-experts model")
    if moe is not None and all(layers) and "mlp" in scope:
        broken.append("mlp captures dense layers' MLPs and every layer is an MoE layer")
    if moe is not None and "moe" in scope:
        dispatcher = "flex" if flex else fixed.moe_token_dispatcher_type or "alltoall"
        if dispatcher != "alltoall":
            broken.append(f"moe is not captured with the {dispatcher} dispatcher")
        elif moe.moe_expert_capacity_factor is None or not moe.moe_pad_expert_input_to_capacity:
            broken.append(
                "moe is captured only when the MoE layers drop and pad to a capacity "
                "(--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity)"
            )
    if moe is not None and "moe_preprocess" in scope and moe.moe_expert_capacity_factor is not None:
        broken.append("moe_preprocess is not captured with a capacity (its preprocessing waits on the host)")
    if broken:
        raise ConfigError(f"{captured}: {'; '.join(broken)}")
    return scope


def graph_constants(args: argparse.Namespace, constants: PerfConstants, model: ModelConfig, fixed: Fixed, gpu):
    """``constants`` with the run's CUDA graphs (:func:`cuda_graph_choice`, :func:`cuda_graph_scope`):
    ``cuda_graphs``, and ``moe_cuda_graphs`` where they hold the MoE layers' router (``local``'s
    whole layers or iteration, or a scope in :data:`MOE_GRAPH_SCOPES`); and a note saying what
    they change."""
    named, impl = cuda_graph_choice(args)
    given = list(getattr(args, "cuda_graph_scope", None) or [])
    scope = cuda_graph_scope(named, impl, given, model, fixed, bool(constants.moe_flex_dispatcher))
    if impl == "none":
        return constants, []
    constants = dataclasses.replace(constants, cuda_graphs=True)
    captured = named + (f" --cuda-graph-scope {' '.join(scope)}" if scope else "")
    if moe_of(model) is None or (impl == "transformer_engine" and not set(scope) & set(MOE_GRAPH_SCOPES)):
        return constants, [
            f"CUDA graphs ({captured}) change no time of this plan, and full recompute is not searched "
            "with them: the planner times graphs of the MoE layers' router"
        ]
    note = (
        "planned as the run does, which ptdp train does not: CUDA graphs replay the MoE layers' router "
        f"({captured}), so the layers' fixed cost ({1e3 * constants.for_gpu(gpu).moe_layer_overhead:.3g} ms per "
        "layer and micro-batch) is not paid; full recompute is not searched with them"
    )
    return dataclasses.replace(constants, moe_cuda_graphs=True), [note]
