"""The GPU check's probes: what the first GPU run must tell about the kernels ptdp relies on,
in the order they run.

- ``wgrad``: whether the fused float32 weight-gradient GEMM (``aten::addmm.dtype_out``: 16-bit
  inputs, float32 output accumulated in place) runs, or falls back to the 16-bit GEMM added into
  float32 (``ptdp.engine.tensor_parallel.wgrad.FUSED_GEMM`` before and after a call at the model's
  shape); a fallback is a failure of the stage. Its error against float64 beside the 16-bit GEMM's.
- ``gemm``: the linear layers' GEMMs at the model's shapes (rows b s; the output layer's as ptdp's
  loss runs it: on a chunk of the rows unless it keeps the logits): forward ``x W^T``, input
  gradient ``g W``, weight gradient ``g^T x`` (and into float32 by ``addmm.dtype_out`` on CUDA),
  TFLOP/s ``2 m n k / t`` and the share of the peak.
- ``step``: a 2-layer model of the timed width through ptdp's ``train_step``: the attention
  operator and kernels of a profiled step, the kernels taking the most time, and (CUDA) the host
  synchronisations of steady-state steps counted by ``torch.cuda.set_sync_debug_mode("warn")``
  (none expected; one more to read the step's metrics).
- ``sdpa``: the causal attention at the model's shape, on q, k, v laid out as ptdp's attention
  makes them (strided views of the fused QKV projection), forward and backward under each
  ``torch.nn.attention.sdpa_kernel`` backend (which run, their times, their output against the
  math backend's), and the backend the default dispatch picks, from the ``aten`` operator and
  kernels torch.profiler records. TFLOP/s count forward and backward as 3 forwards of the
  causal half: ``3 * 2 b a s^2 d``.

On a CPU the CUDA-only parts say :data:`~gpu_report.NOT_ON_CPU`; the rest runs at the CPU's shapes.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_models import device_stage, random_microbatches, speed_config
from gpu_report import NOT_ON_CPU, Budget, median_seconds

from ptdp.config.schema import Config
from ptdp.engine.stage import Stage
from ptdp.engine.step import train_step
from ptdp.engine.tensor_parallel import wgrad
from ptdp.engine.tensor_parallel.linear_cross_entropy import default_chunk_tokens
from ptdp.layout.vocab import keeps_logits, padded_vocab_size

BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
"""The SDPA backends tried, in this order (the math backend first: the others are compared with it)."""
ATTENTION_OPS = (
    ("cudnn_attention", "CUDNN_ATTENTION"),
    ("efficient_attention", "EFFICIENT_ATTENTION"),
    ("flash_attention", "FLASH_ATTENTION"),
    ("attention_math", "MATH"),
    ("fused_attention_overrideable", "OVERRIDEABLE"),
)
"""A fragment of the ``aten`` operator each SDPA backend runs (``aten::_scaled_dot_product_<...>``)."""
KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")
REPS = 10
SYNC_STEPS = 3


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _sixteen_bit(dtype: str) -> torch.dtype:
    """The 16-bit dtype a probe uses: the checked one, else bfloat16."""
    return torch.float16 if dtype == "float16" else torch.bfloat16


def probe_wgrad(config: Config, device: torch.device, budget: Budget) -> dict:
    """One weight gradient of the QKV projection (``[3h, b s] . [b s, h]``) through ptdp's
    ``add_weight_grad``: which path ran, its error against float64, its time."""
    if device.type != "cuda":
        return {"status": NOT_ON_CPU, "note": "the CPU path is a 16-bit GEMM added into float32 by design"}
    m = config.model
    n, h = config.train.micro_batch_size * m.seq_length, m.hidden_size
    dtype = _sixteen_bit(m.params_dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(n, 3 * h, device=device, generator=gen).to(dtype)
    x = torch.randn(n, h, device=device, generator=gen).to(dtype)
    main = torch.zeros(3 * h, h, device=device)
    before = dataclasses.asdict(wgrad.FUSED_GEMM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        wgrad.add_weight_grad(main, g, x)
    torch.cuda.synchronize(device)
    after = dataclasses.asdict(wgrad.FUSED_GEMM)
    fused = after["fused"] > before["fused"]
    exact = g.double().t() @ x.double()
    scale = exact.abs().max()
    out = {
        "status": "fused" if fused else "fell back",
        "shape": {"rows": n, "out": 3 * h, "in": h, "dtype": str(dtype)},
        "error": after["error"],
        # False: this torch runs no post-accumulate hook without a gradient, so training keeps
        # autograd's 16-bit weight gradients and never calls the fused GEMM (wgrad.fuse_here)
        "layers_fuse": wgrad.hooks_run_without_grad(),
        "warnings": [str(w.message) for w in caught],
        "max_rel_err_vs_float64": float((main.double() - exact).abs().max() / scale),
        "gemm_16_bit_max_rel_err_vs_float64": float(((g.t() @ x).double() - exact).abs().max() / scale),
    }
    out["seconds"], _ = median_seconds(lambda: wgrad.add_weight_grad(main, g, x), device, REPS, budget)
    out["gemm_16_bit_plus_add_seconds"], _ = median_seconds(lambda: main.add_(g.t().mm(x)), device, REPS, budget)
    return out


def attention_backend(op_names) -> str | None:
    """The SDPA backend whose ``aten`` operator is among ``op_names`` (:data:`ATTENTION_OPS`), or None."""
    for fragment, backend in ATTENTION_OPS:
        if any(fragment in name for name in op_names):
            return backend
    return None


def _profile(fn, device: torch.device) -> list[dict]:
    """``fn()`` once under torch.profiler: every operator and kernel with its device type, calls
    and self times (microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = []
    for avg in prof.key_averages():
        device_us = getattr(avg, "self_device_time_total", None)
        if device_us is None:  # older torch
            device_us = getattr(avg, "self_cuda_time_total", 0)
        rows.append(
            {
                "name": avg.key,
                "device_type": str(getattr(avg, "device_type", "")).rsplit(".", 1)[-1],
                "calls": avg.count,
                "self_device_us": device_us,
                "self_cpu_us": avg.self_cpu_time_total,
            }
        )
    return rows


def _attention_seen(rows: list[dict], device: torch.device) -> dict:
    """The attention operators and (CUDA) kernels among profiled ``rows`` and the backend they show."""
    ops = sorted({r["name"] for r in rows if r["name"].startswith("aten::_scaled_dot_product")})
    kernels: list[str] | str = sorted(
        {r["name"] for r in rows if r["device_type"] == "CUDA" and any(w in r["name"].lower() for w in KERNEL_WORDS)}
    )
    return {
        "backend": attention_backend(ops),
        "aten_ops": ops,
        "kernels": kernels if device.type == "cuda" else NOT_ON_CPU,
    }


def _qkv_of(stage: Stage, rows: int, batch: int, device: torch.device, dtype: torch.dtype):
    """A leaf ``[s, b, 3h]`` QKV projection output and ptdp's first layer's ``split_heads`` of it."""
    attention = next(iter(stage.model.layers.values())).attention
    width = 3 * attention.local_heads * attention.head_dim
    gen = torch.Generator(device=device).manual_seed(1)
    qkv = torch.randn(rows, batch, width, device=device, generator=gen).to(dtype).requires_grad_()
    return qkv, attention.split_heads


def probe_sdpa(stage: Stage, device: torch.device, budget: Budget) -> dict:
    """Causal attention at ``stage``'s shape under each backend and under the default dispatch."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:  # torch < 2.3
        return {"status": f"torch.nn.attention.sdpa_kernel is missing: {_first_line(e)}"}
    m = stage.config.model
    s, b = m.seq_length, stage.config.train.micro_batch_size
    dtype = stage.model.word_embeddings.weight.dtype
    qkv, split = _qkv_of(stage, s, b, device, dtype)
    q0 = split(qkv)[0]
    flops = 3 * 2 * q0.shape[0] * q0.shape[1] * s * s * q0.shape[3]
    grad = torch.randn(q0.shape, device=device, dtype=dtype)

    def forward():
        q, k, v = split(qkv)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        torch.autograd.grad(forward(), qkv, grad)

    out: dict = {
        "shape": {"b": q0.shape[0], "heads": q0.shape[1], "s": s, "d": q0.shape[3], "dtype": str(dtype)},
        "layout": "strided [b, heads, s, d] views of ptdp's [s, b, 3h] QKV output",
        "backends": {},
    }
    reference = None
    for name in BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            out["backends"][name] = {"ok": False, "error": f"torch {torch.__version__} has no SDPBackend.{name}"}
            continue
        if not budget.allows(0):
            out["backends"][name] = {"ok": False, "error": "not tried: the stage's budget was spent"}
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    result = forward().detach()
                    seconds, timed = median_seconds(forward_backward, device, REPS, budget)
            except RuntimeError as e:
                reasons = [str(w.message).splitlines()[0] for w in caught][:4]
                out["backends"][name] = {"ok": False, "error": _first_line(e), "why": reasons}
                continue
        entry = {"ok": True, "fwd_bwd_s": seconds, "timed": timed, "tflops": flops / seconds / 1e12}
        if reference is None:
            reference = result.float()
        entry["max_abs_diff_vs_math"] = float((result.float() - reference).abs().max())
        out["backends"][name] = entry
    out["default"] = _attention_seen(_profile(forward_backward, device), device)
    times = {n: e.get("fwd_bwd_s") for n, e in out["backends"].items() if e.get("ok")}
    if times.get("CUDNN_ATTENTION") and times.get("FLASH_ATTENTION"):
        out["cudnn_over_flash_time"] = times["CUDNN_ATTENTION"] / times["FLASH_ATTENTION"]
    return out


def probe_gemms(config: Config, device: torch.device, budget: Budget, peak: float | None) -> dict:
    """Each linear layer's three GEMMs (and the float32-output weight gradient on CUDA) at the
    model's shapes, in the checked 16-bit dtype on CUDA (float32 on a CPU)."""
    m = config.model
    h, f = m.hidden_size, m.ffn
    v_pad = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    n = config.train.micro_batch_size * m.seq_length
    cuda = device.type == "cuda"
    dtype = _sixteen_bit(m.params_dtype) if cuda else torch.float32
    kept = keeps_logits(n, v_pad, torch.finfo(dtype).bits // 8)  # else ptdp's loss recomputes them in chunks
    layers = {
        "qkv": (n, 3 * h, h),
        "proj": (n, h, h),
        "fc1": (n, f, h),
        "fc2": (n, h, f),
        "logits": (n if kept else min(n, default_chunk_tokens(v_pad)), v_pad, h),
    }
    out: dict = {"dtype": str(dtype), "peak_flops": peak, "shapes": "rows, out, in", "gemms": {}}
    gen = torch.Generator(device=device).manual_seed(2)
    for layer, (rows, width_out, width_in) in layers.items():
        if not budget.allows(0):
            out["gemms"][layer] = {"status": "not run: the stage's budget was spent"}
            continue
        x = torch.randn(rows, width_in, device=device, generator=gen).to(dtype)
        w = torch.randn(width_out, width_in, device=device, generator=gen).to(dtype)
        g = torch.randn(rows, width_out, device=device, generator=gen).to(dtype)
        ops = {"forward": lambda: x @ w.t(), "input_grad": lambda: g @ w, "weight_grad": lambda: g.t() @ x}
        if cuda:
            main = torch.zeros(width_out, width_in, device=device)
            ops["weight_grad_into_float32"] = lambda: torch.ops.aten.addmm.dtype_out(
                main, g.t(), x, torch.float32, out=main
            )
        entry: dict = {"rows": rows, "out": width_out, "in": width_in}
        for op, fn in ops.items():
            try:
                seconds, _ = median_seconds(fn, device, REPS, budget)
            except (AttributeError, NotImplementedError, RuntimeError) as e:
                entry[op] = {"error": _first_line(e)}
                continue
            tflops = 2 * rows * width_out * width_in / seconds / 1e12
            entry[op] = {"s": seconds, "tflops": tflops, "of_peak": tflops * 1e12 / peak if peak else None}
        out["gemms"][layer] = entry
    return out


def _site(w: warnings.WarningMessage) -> str:
    """``file:line`` of a warning, the file from ``ptdp/`` or ``benchmarks/`` on (else its name)."""
    parts = Path(w.filename).parts
    for root in ("ptdp", "benchmarks", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1 :]) + f":{w.lineno}"
    return f"{Path(w.filename).name}:{w.lineno}"


def count_syncs(stage: Stage, mbs, device: torch.device, first_iteration: int) -> dict:
    """Host synchronisations of :data:`SYNC_STEPS` steady-state ``train_step`` calls and of reading
    the last one's metrics, from ``torch.cuda.set_sync_debug_mode("warn")``'s warnings."""
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            pending = [train_step(stage, mbs, first_iteration + i) for i in range(SYNC_STEPS)]
            in_steps = [w for w in caught if "synchroniz" in str(w.message)]
            pending[-1].result()
            in_read = [w for w in caught if "synchroniz" in str(w.message)][len(in_steps) :]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return {
        "steps": SYNC_STEPS,
        "per_step": len(in_steps) / SYNC_STEPS,
        "reading_the_metrics": len(in_read),
        "sites": dict(collections.Counter(_site(w) for w in in_steps + in_read).most_common(10)),
    }


def probe_step(stage: Stage, device: torch.device, budget: Budget) -> dict:
    """``stage`` through ``train_step``: a profiled step's attention and top kernels, and (CUDA)
    host synchronisations per steady-state step."""
    mbs = [(x.to(device), y.to(device)) for x, y in random_microbatches(stage.config, seed=0)]
    for i in range(2):  # first allocations, cuBLAS and cuDNN handles
        train_step(stage, mbs, i).result()
    rows = _profile(lambda: train_step(stage, mbs, 2).result(), device)
    out: dict = {"attention": _attention_seen(rows, device)}
    if device.type == "cuda":
        kernels = sorted((r for r in rows if r["device_type"] == "CUDA"), key=lambda r: -r["self_device_us"])
        total = sum(r["self_device_us"] for r in kernels) or 1.0
        out["top_kernels"] = [
            {
                "name": r["name"][:160],
                "calls": r["calls"],
                "us": r["self_device_us"],
                "share": r["self_device_us"] / total,
            }
            for r in kernels[:15]
        ]
        out["host_syncs"] = count_syncs(stage, mbs, device, 3) if budget.allows(0) else {"status": "not run: budget"}
    else:
        out["top_kernels"] = {"status": NOT_ON_CPU}
        out["host_syncs"] = {"status": NOT_ON_CPU}
    return out


def probe_model(shape: dict, dtype: str, device: torch.device) -> Stage:
    """The probes' ptdp stage: ``shape`` with 2 layers, weights drawn on the device."""
    return device_stage(speed_config(dict(shape, num_layers=2), dtype), device)
