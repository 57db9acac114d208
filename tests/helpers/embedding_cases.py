"""The word embedding's gradient straight into ``main_grad`` against autograd's path: what the unit and
the multi-process tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers.layout_cases import rank_microbatches
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.tensor_parallel import wgrad

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class SixteenBitTensorsOfShape(TorchDispatchMode):
    """Records every op whose output is a 16-bit tensor of ``shape`` (a gradient of the table)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.ops = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in SIXTEEN_BIT and tuple(t.shape) == self.shape:
                self.ops.append(str(func))
        return out


@contextlib.contextmanager
def autograd_path() -> Iterator[None]:
    """The lookup (and the linear layers) without fusion: autograd's 16-bit weight gradient, which the
    buffer's hook adds into ``main_grad`` (the way ptdp computed it before the fusion)."""
    saved = wgrad.fuse_here
    wgrad.fuse_here = lambda weight: False
    try:
        yield
    finally:
        wgrad.fuse_here = saved


def table_gradients_made(weight: torch.Tensor, backward: Callable[[], None]) -> list[str]:
    """The ops of ``backward()`` that produce a 16-bit tensor shaped like ``weight``."""
    with SixteenBitTensorsOfShape(weight.shape) as mode:
        backward()
    return mode.ops


def embedding_gradients(
    cfg: Config, groups: ParallelGroups, *, fused: bool, microbatches: int = 2, distinct: int | None = None
) -> dict:
    """Backward of this rank's first ``microbatches`` microbatches of step 0 on a fresh stage of ``cfg``
    (all but the last under ``no_sync``, as a step runs them), with or without the fusion; with
    ``distinct`` the token ids are taken modulo it (many repeated tokens per microbatch).

    Returns ``word`` (the word embedding's gradient buffer after :meth:`GradBuffer.finish`: summed over
    dp, float32), ``output`` (the untied output layer's, or None), ``arrived`` (per accumulation of the
    word embedding: whether autograd brought it a gradient), ``hooks`` (how often the buffer's
    post-accumulate hook ran for it), ``grad_is_none`` and ``started`` (whether its bucket's dp
    reduction started in backward), ``lookup`` (the lookup's own gradient, float64: the output
    gradients it received, summed per id; this rank's rows, on this dp rank; zero with sequence
    parallelism)."""
    with contextlib.nullcontext() if fused else autograd_path():
        stage = build_stage(cfg, groups)
        model, grads = stage.model, stage.grads
        weight = model.word_embeddings.weight
        arrived, hooks = [], []
        weight.register_hook(lambda g: arrived.append(g is not None))
        weight.register_post_accumulate_grad_hook(lambda p: hooks.append(1))
        lookup = torch.zeros(weight.shape, dtype=torch.float64)
        start = model.word_embeddings.vocab_start

        def received(module, args, out):  # the lookup's output gradient, summed per id of this shard
            ids = args[0].reshape(-1) - start
            mine = (ids >= 0) & (ids < weight.shape[0])

            def add(grad):
                rows = grad.double().reshape(-1, grad.shape[-1])
                lookup.index_add_(0, ids[mine], rows[mine])

            out.register_hook(add)

        if not model.sequence_parallel:  # (with it the module's output is this rank's positions only)
            model.word_embeddings.register_forward_hook(received)
        grads.zero()
        mbs = rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size)[:microbatches]
        for i, (tokens, labels) in enumerate(mbs):
            tokens, labels = (tokens, labels) if distinct is None else (tokens % distinct, labels % distinct)
            with contextlib.nullcontext() if i == len(mbs) - 1 else grads.no_sync():
                model(tokens, labels).float().backward()
        bucket = next(b for b in grads.buckets if any(p is weight for p in b.params))
        started = bucket.finish is not None
        grads.finish()
    output = model.output_layer.weight if hasattr(model, "output_layer") else None
    return {
        "word": grads.grad(weight).clone(),
        "output": None if output is None else grads.grad(output).clone(),
        "arrived": arrived,
        "hooks": len(hooks),
        "grad_is_none": weight.grad is None,
        "started": started,
        "lookup": lookup,
    }


LOOKUP_VOCAB, LOOKUP_PADDED, LOOKUP_H = 13, 16, 8  # tp = 2: rank 1 holds rows 8..15, 13..15 padding


def lookup_inputs() -> dict:
    """A global ``[16, 8]`` table (padding rows zero), ids ``[s=6, b=3]`` with repeated tokens, and
    the output gradient ``[6, 3, 8]``, all float64."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(LOOKUP_PADDED, LOOKUP_H, generator=g, dtype=torch.float64)
    table[LOOKUP_VOCAB:] = 0
    ids = torch.randint(0, 5, (6, 3), generator=g)  # few distinct ids: many repeats
    ids[0] = torch.tensor([9, 12, 9])  # and some on the second half of the table
    return {"table": table, "ids": ids, "grad": torch.randn(6, 3, LOOKUP_H, generator=g, dtype=torch.float64)}


def lookup_reference(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The table's gradient, ``[16, 8]`` float64: the rows of the output gradient (rounded to
    ``dtype``, as the lookup receives it) summed per id in float64."""
    d = lookup_inputs()
    rows = d["grad"].to(dtype).double().reshape(-1, LOOKUP_H)
    return torch.zeros_like(d["table"]).index_add_(0, d["ids"].reshape(-1), rows)


def lookup_run(tp, dtype: torch.dtype, *, main_grad: bool) -> dict:
    """This rank's vocab-parallel embedding of the :func:`lookup_inputs` table in ``dtype`` (with a
    ``main_grad`` (float32 for 16-bit weights), or autograd's ``.grad``): forward and backward of the given gradient (in
    ``dtype``), twice (two microbatches). Returns ``out`` (the first output), ``grad`` (main_grad or
    .grad, float64), ``made`` (ops that made a 16-bit tensor shaped like the table in backward),
    ``arrived`` (per backward: whether autograd brought the weight a gradient), ``hooks`` (how often its
    post-accumulate hook ran), ``grad_is_none`` and ``rows`` (this rank's rows of the table)."""
    from ptdp.engine.tensor_parallel.layers import VocabParallelEmbedding
    from ptdp.engine.tensor_parallel.sharding import shard

    d = lookup_inputs()
    emb = VocabParallelEmbedding(LOOKUP_VOCAB, LOOKUP_PADDED, LOOKUP_H, tp=tp, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(shard(d["table"], emb.weight.ptdp_global, tp.rank, tp.size))
    if main_grad:
        emb.weight.main_grad = torch.zeros(emb.weight.shape, dtype=torch.float32 if dtype in SIXTEEN_BIT else dtype)
    arrived, hooks, made, outs = [], [], [], []
    emb.weight.register_hook(lambda g: arrived.append(g is not None))
    emb.weight.register_post_accumulate_grad_hook(lambda p: hooks.append(1))
    for _ in range(2):
        out = emb(d["ids"])
        outs.append(out.detach())
        made += table_gradients_made(emb.weight, lambda: out.backward(d["grad"].to(dtype)))
    grad = emb.weight.main_grad if main_grad else emb.weight.grad
    return {
        "out": outs[0],
        "grad": grad.double(),
        "made": made,
        "arrived": arrived,
        "hooks": len(hooks),
        "grad_is_none": emb.weight.grad is None,
        "rows": (emb.vocab_start, emb.vocab_end),
    }
