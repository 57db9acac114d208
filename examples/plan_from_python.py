"""Plan a Llama 3 70B run from Python: the best layout, why, and the flags that run it.

python examples/plan_from_python.py
"""

import ptdp

result = ptdp.plan("llama3-70b", gpus=512, gpu="h100-sxm", global_batch_size=1024, seq_length=8192)
best = result.best  # None when no layout fits (result.rejected says why)
if best is None:
    raise SystemExit("no layout fits:\n" + result.report())
lay = best.layout
time, memory = best.need_time(), best.need_memory()  # a fitting plan's predictions (typed, never None)
print(f"best of {len(result.plans)} fitting layouts ({len(result.rejected)} rejected):")
print(
    f"  tp {lay.tp}  cp {lay.cp}  pp {lay.pp}  dp {lay.dp}  micro batch {lay.micro_batch_size}  "
    f"v {lay.virtual_stages}  recompute {lay.recompute}  sharding {lay.sharding_strategy}"
)
print(
    f"  {time.step:.2f} s per step, {best.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {best.mfu:.1%}, "
    f"{memory.total / 2**30:.1f} GiB on the most loaded GPU"
)
print("\n".join(result.explanation))

# the same question with the tensor-parallel size fixed: how far from the best?
fixed = ptdp.plan("llama3-70b", gpus=512, gpu="h100-sxm", global_batch_size=1024, seq_length=8192, tp=8)
if fixed.best is not None:
    step = fixed.best.need_time().step
    print(f"\nwith tp 8: {step:.2f} s per step ({step / time.step - 1:+.1%})")

# a bad request raises ConfigError, naming the numbers and the rule (ptdp plan exits 2 with it)
try:
    ptdp.plan("llama3-70b", gpus=512, global_batch_size=1024, tp=3)
except ptdp.ConfigError as error:
    print(f"\nrefused: {error}")

# a training configuration, checked by the same rules as `ptdp train`
config = ptdp.load_config(
    world_size=8,
    tp=2,
    pp=2,
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    micro_batch_size=2,
    global_batch_size=16,
    train_iters=10,
)
print(
    f"\nconfig: tp {config.parallel.tp} pp {config.parallel.pp} dp {config.parallel.dp}, "
    f"{config.num_microbatches} microbatches per step"
)
