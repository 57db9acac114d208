"""The GPU check's ``moe`` stage: a small mixture-of-experts GPT trained a few steps on one device,
and the experts' grouped GEMM timed against the per-expert loop.

The model (:data:`MOE_FULL`): ``gpu_models.speed_config``'s GPT with 8 layers, h = 1024, 16 heads,
s = 1024 and GPT-2's vocabulary, every MLP an MoE layer of E = 8 experts of width 4h / 2 = 2048,
top-2 (``moe_common``: a dense GPT's active weights per token), learned softmax routing, no
balancing loss; tp = pp = dp = ep = 1, bf16 parameters on a GPU (float32 on a CPU), weights drawn
on the device (``gpu_models.device_stage``), the experts as one grouped GEMM
(``--moe-grouped-gemm``). It trains ``warmup + steps`` steps on one fixed batch at a constant
learning rate of 5e-4, so the loss must fall: a loss that is not finite, or a last loss not below
the first, fails the stage. Step time (wall clock; each step's metrics are read, so it has ended
on the device) and tokens/s: medians over the steps after the warm-up; each step's
``moe_max_load`` (the most loaded expert's load over the mean). Then, budget permitting, the same
run with FP8 GEMMs (rowwise, the experts' too): its losses, and beside bf16's its last loss and
tokens/s.

The grouped GEMM is ``torch._grouped_mm(x, W^T, offs)`` with ``x`` ``[T k, in]`` sorted by expert,
the stacked weight ``[E, out, in]`` and the cumulative counts (``ptdp.engine.moe.experts``). Its
rules in torch 2.11 (``_grouped_mm_validate_inputs`` of ``aten/src/ATen/native/GroupedMMUtils.h``,
``_grouped_mm_cuda`` of ``native/cuda/GroupedBlas.cpp``, the same in its meta function): float32,
bfloat16 or float16 operands of one dtype (ptdp: float32 and bfloat16), int32 offsets, each
operand's leading stride a multiple of 16 bytes (``h`` and ``F`` multiples of 8 in bf16), and on
CUDA each data pointer 16-byte aligned; a CUTLASS kernel runs for bf16 on compute capability 9.0
(H100, H200) and 10.x only, elsewhere torch loops over the groups itself (reading the offsets on
the host).
:func:`grouped_gemm_rules` records them for the model's experts; the first grouped-vs-loop row, at
the model's expert shape, is the trial: if it raises, the model's experts run as the loop and the
stage fails; if the rules say no, they run as the loop with a note. Then :data:`GEMM_SIZES` (more,
smaller experts), each in the model's dtype (``moe_common.time_expert_gemms``); outputs of the two
further apart than the precision's rounding (``gpu_loss.loss_bound``) fail the stage. The training
runs last.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from gpu_loss import loss_bound
from gpu_models import FULL, QUICK, device_stage, random_microbatches, speed_config
from gpu_report import NOT_ON_CPU, Budget, StageReport, train_steps
from moe_common import active_weights, moe_options, time_expert_gemms

from ptdp.config.fp8 import FP8Config
from ptdp.config.schema import Config
from ptdp.engine.moe.expert_linear import GROUPED_DTYPES
from ptdp.engine.moe.experts import Experts
from ptdp.engine.stage import Stage
from ptdp.engine.step import train_step

EXPERTS = {"num_experts": 8, "topk": 2}
MOE_FULL = FULL | EXPERTS | {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024}
"""The model: the eager row's shape (``gpu_models.FULL``) narrower and shorter, with experts."""
MOE_QUICK = QUICK | EXPERTS
"""The ``--quick`` shape."""
GEMM_SIZES = [(64, 2048, 1024, 16384), (128, 2048, 512, 16384)]
"""(E, h, F, tokens) timed after the model's own expert shape on a GPU."""
QUICK_GEMM_SIZES = [(32, 64, 32, 256)]
LR = 5e-4
GEMM_REPS = 10
RESERVE_S = 5.0
"""Seconds of the budget kept for the last synchronisation and the report."""


def moe_config(shape: dict, dtype: str) -> Config:
    """The stage's resolved single-process config (module docstring)."""
    dense = speed_config(shape, dtype)
    moe = moe_options(dense.model.ffn, num_experts=shape["num_experts"], topk=shape["topk"])
    config = speed_config(shape, dtype, moe)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, lr=LR, min_lr=LR))


def experts_of(stage: Stage) -> list[Experts]:
    return [m for m in stage.model.modules() if isinstance(m, Experts)]


def grouped_gemm_rules(stage: Stage, device: torch.device) -> dict:
    """torch 2.11's rules for ``torch._grouped_mm`` (module docstring) checked on the model's experts;
    ``usable``: all hold."""
    experts = experts_of(stage)
    weight = experts[0].fc1_weight
    item = weight.element_size()
    hidden, ffn = weight.shape[2], weight.shape[1]
    out: dict = {
        "torch_has_grouped_mm": hasattr(torch, "_grouped_mm"),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "dtype_taken": weight.dtype in GROUPED_DTYPES,
        "offsets": "int32 (the cumulative counts, converted)",
        "h_F_rows_multiple_of_16_bytes": (hidden * item) % 16 == 0 and (ffn * item) % 16 == 0,
        "weights_16_byte_aligned": all(p.data_ptr() % 16 == 0 for e in experts for p in e.parameters()),
    }
    out["usable"] = all(v for k, v in out.items() if k != "dtype" and k != "offsets")
    if device.type != "cuda":
        out["cutlass_kernel"] = NOT_ON_CPU
    else:
        major, minor = torch.cuda.get_device_capability(device)
        fast = ((major, minor) == (9, 0) or major == 10) and weight.dtype == torch.bfloat16
        out["compute_capability"] = f"{major}.{minor}"
        out["cutlass_kernel"] = "yes" if fast else "no: torch loops over the groups (a host synchronisation)"
    return out


def _use_loop(stage: Stage) -> None:
    for e in experts_of(stage):
        e.grouped = False


def _gemm_row(size: tuple[int, int, int, int], topk: int, dtype: torch.dtype, device, budget: Budget) -> dict:
    e, h, f, t = size
    return time_expert_gemms(
        num_experts=e, hidden=h, ffn=f, tokens=t, topk=topk, dtype=dtype, device=device, reps=GEMM_REPS, budget=budget
    )


def run_moe_stage(shape: dict, dtype: str, device: torch.device, budget: Budget, report: StageReport) -> None:
    """The stage's items into ``report["moe"]``, each written as soon as it is known."""
    config = moe_config(shape, dtype)
    m, moe = config.model, config.moe
    tokens = config.train.global_batch_size * m.seq_length
    data: dict = {
        "model": {
            **{k: shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")},
            "num_experts": moe.num_experts,
            "topk": moe.moe_router_topk,
            "expert_ffn": moe.expert_ffn(m.ffn),
            "dense_ffn": m.ffn,
            "active_weights": active_weights(m.hidden_size, m.ffn, moe)["text"],
        },
        "batch": {
            "micro_batch_size": shape["micro_batch_size"],
            "num_microbatches": shape["num_microbatches"],
            "tokens_per_step": tokens,
        },
        "gemm": [],
    }
    report.update(moe=data)
    t0 = time.perf_counter()
    stage = device_stage(config, device)
    data["build_s"] = time.perf_counter() - t0
    data["model"]["parameters"] = sum(p.numel() for p in stage.model.parameters())
    rules = data["grouped_gemm"] = grouped_gemm_rules(stage, device)
    report.write()
    torch_dtype = getattr(torch, dtype)
    own = (moe.num_experts, m.hidden_size, moe.expert_ffn(m.ffn), config.train.micro_batch_size * m.seq_length)
    if not rules["usable"]:
        rules["status"] = "not used: a rule above does not hold; the experts run as the loop"
        report.note(f"moe: the grouped GEMM {rules['status']}")
        _use_loop(stage)
    else:
        try:
            data["gemm"].append(_gemm_row(own, moe.moe_router_topk, torch_dtype, device, budget))
            rules["status"] = "used"
        except Exception as e:
            rules["status"] = f"fell back: {type(e).__name__}: {e}"
            report.fail(f"moe: the grouped GEMM {rules['status']}; the experts ran as the loop")
            _use_loop(stage)
    report.write()
    sizes = GEMM_SIZES if device.type == "cuda" else QUICK_GEMM_SIZES
    for size in sizes if rules["status"] == "used" else []:
        if not budget.allows(RESERVE_S):
            report.out_of_budget(f"moe: grouped GEMM timing at (E, h, F, tokens) = {size}")
            break
        data["gemm"].append(_gemm_row(size, moe.moe_router_topk, torch_dtype, device, budget))
        report.write()
    _check_gemm_rows(data["gemm"], dtype, device, report)
    train_moe(stage, shape, tokens, budget, data, report)
    del stage
    train_moe_fp8(shape, dtype, device, tokens, budget, data, report)


def _check_gemm_rows(rows: list[dict], dtype: str, device: torch.device, report: StageReport) -> None:
    bound = loss_bound(dtype, device)  # the precision's rounding, as for the losses
    for r in rows:
        if not r["max_rel_diff_grouped_vs_loop"] <= bound:
            report.fail(
                f"moe: grouped GEMM and loop differ by {r['max_rel_diff_grouped_vs_loop']:.2e} (relative, bound "
                f"{bound:.0e}) at E {r['num_experts']}, h {r['hidden']}, F {r['ffn']}"
            )


def train_moe(
    stage: Stage, shape: dict, tokens: int, budget: Budget, data: dict, report: StageReport, key: str = "training"
) -> None:
    """``warmup + steps`` steps on one fixed batch into ``data[key]`` (module docstring)."""
    mbs = [(x.to(stage.device), y.to(stage.device)) for x, y in random_microbatches(stage.config, seed=0)]
    run: dict = {"max_load": []}
    data[key] = run

    def step(i: int):
        result = train_step(stage, mbs, i).result()
        run["max_load"].append(result.moe["moe_max_load"] if result.moe else None)
        return result

    train_steps(
        step,
        run,
        warmup=shape["warmup"],
        steps=shape["steps"],
        tokens=tokens,
        budget=budget,
        report=report,
        what=f"moe {key}",
        reserve_s=RESERVE_S,
    )


def train_moe_fp8(
    shape: dict, dtype: str, device: torch.device, tokens: int, budget: Budget, data: dict, report: StageReport
) -> None:
    """The same model and steps with every linear's and expert's GEMMs in FP8 (rowwise, hybrid;
    ``ptdp.engine.moe.expert_linear``) into ``data["training_fp8_rowwise"]``, when the budget
    allows: its losses (the stage fails when they are not finite or do not fall), the last loss's
    difference from bf16's and the tokens/s ratio (reported, not judged)."""
    if not budget.allows(4 * RESERVE_S):
        report.out_of_budget("moe: the FP8 run")
        return
    config = moe_config(shape, dtype)
    config = dataclasses.replace(config, fp8=FP8Config(fp8_format="hybrid", fp8_recipe="rowwise"))
    stage = device_stage(config, device)
    train_moe(stage, shape, tokens, budget, data, report, key="training_fp8_rowwise")
    base, fp8 = data.get("training", {}), data["training_fp8_rowwise"]
    if base.get("losses") and fp8.get("losses") and len(base["losses"]) == len(fp8["losses"]):
        fp8["last_loss_diff_vs_bf16"] = fp8["losses"][-1] - base["losses"][-1]
    if base.get("tokens_per_s") and fp8.get("tokens_per_s"):
        fp8["tokens_per_s_ratio_vs_bf16"] = fp8["tokens_per_s"] / base["tokens_per_s"]
    report.write()
