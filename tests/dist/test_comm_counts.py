"""Invariant 2: one training step at tp=2, pp=2, dp=2 communicates exactly what the formulas say.

Per microbatch and layer (Shoeybi et al. 2019 §3; Narayanan et al. 2021 §3.2): TP 2 all-reduces
forward (attention output, MLP output) and 2 backward (before QKV and fc1), each b*s*h elements;
the embedding adds 1 forward all-reduce of b*s*h on the first stage; the output layer 1 backward
all-reduce of b*s*h and the vocab-parallel cross entropy 3 all-reduces of b*s on the last stage.
PP: one b*s*h send per microbatch per stage boundary each way. DP: the stage's gradient elements
once per step (here in two buckets: the tied embedding is reduced on its own). Embedding group: one all-reduce of the [V_pad/tp, h] word embedding.
Without activation recomputation; the forward all-reduces a recompute repeats are counted in
tests/dist/test_recompute_dist.py. With sequence parallelism (Korthikanti et al. 2022 §4.2.2) the tp
all-reduces of b*s*h become all-gathers and reduce-scatters of the same ring volume.
"""

from __future__ import annotations

from helpers.layout_cases import parallel_run, tiny_config
from ptdp.layout.vocab import padded_vocab_size


def _count(comm: dict, axis: str, op: str, tag: str | None = None) -> tuple[int, int]:
    calls = numel = 0
    for key, c in comm.items():
        a, o, t = key.split("/")
        if a == axis and o == op and (tag is None or t == tag):
            calls += c["calls"]
            numel += c["numel"]
    return calls, numel


def test_one_step_at_tp2_pp2_dp2_matches_formulas():
    cfg = tiny_config(2, 2, 2, "float64")
    b, s, h = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    m = cfg.num_microbatches
    layers = cfg.model.num_layers // 2
    bsh = b * s * h
    v_local = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 2) // 2
    results = parallel_run(2, 2, 2)
    assert m == 2 and layers == 2
    for res in results:
        r = res["float64"]
        comm, (_, _, pp_rank) = r["comm"], r["coords"]
        first, last = pp_rank == 0, pp_rank == 1
        # tensor parallel, inside the transformer layers
        for tag in ("attn_proj", "mlp_fc2", "attn_qkv", "mlp_fc1"):
            assert _count(comm, "tp", "all_reduce", tag) == (layers * m, layers * m * bsh), tag
        # tensor parallel, embedding / output layer / loss
        assert _count(comm, "tp", "all_reduce", "embedding") == ((m, m * bsh) if first else (0, 0))
        assert _count(comm, "tp", "all_reduce", "output") == ((m, m * bsh) if last else (0, 0))
        for tag in ("ce_max", "ce_target", "ce_sum_exp"):
            assert _count(comm, "tp", "all_reduce", tag) == ((m, m * b * s) if last else (0, 0)), tag
        assert _count(comm, "tp", "all_reduce", "grad_norm") == (1, 1)
        tp_total = 4 * layers * m + (m if first else 0) + (m + 3 * m if last else 0) + 1
        assert _count(comm, "tp", "all_reduce")[0] == tp_total
        # pipeline: activations forward, gradients backward, b*s*h each
        sends = _count(comm, "pp", "send")
        recvs = _count(comm, "pp", "recv")
        assert sends == (m, m * bsh) and recvs == (m, m * bsh)
        # data parallel: the stage's gradients, once: one bucket, plus the tied embedding's own
        # bucket (reduced after its first/last-stage sum) on the stages that hold it
        assert _count(comm, "dp", "all_reduce", "grads") == (2, r["grad_numel"])
        assert _count(comm, "dp", "all_reduce") == (2, r["grad_numel"])
        # tied embedding between first and last stage
        assert _count(comm, "embedding", "all_reduce") == (1, v_local * h)
        assert _count(comm, "pp", "all_reduce", "grad_norm") == (1, 1)
        # the loss, and how many ranks found a non-finite loss / gradient norm (skip flags)
        assert _count(comm, "world", "all_reduce", "metrics") == (1, 3)
        axes = {key.split("/")[0] for key in comm}
        assert axes == {"tp", "pp", "dp", "embedding", "world"}


def _ring_elements(comm: dict, tp: int, tags: tuple[str, ...]) -> float:
    """Elements a ring moves per rank for the tp collectives of ``tags``: all-reduce of N
    2(t-1)/t N; reduce-scatter of N (t-1)/t N; all-gather of n per rank (N = t n) (t-1) n."""
    factor = {"all_reduce": 2 * (tp - 1) / tp, "reduce_scatter": (tp - 1) / tp, "all_gather": tp - 1}
    return sum(factor[op] * _count(comm, "tp", op, tag)[1] for op in factor for tag in tags)


def test_sequence_parallel_step_at_tp2_pp2_dp2_matches_formulas():
    """Sequence parallelism [K22 §4.2.2]: each tp all-reduce of b*s*h becomes an all-gather (entry:
    QKV, fc1, output layer) or a reduce-scatter (exit: attention projection, fc2, embedding) in
    forward and the other one in backward, b*s*h elements in total each, so a ring moves as much as
    before; the QKV, fc1 and output-layer inputs are kept as shards and gathered again in backward
    (one more all-gather of b*s*h each). Pipeline transfers carry b*s*h/t. After backward one tp
    all-reduce sums the gradients of the parameters applied to sequence shards (norms, the two
    row-parallel biases per layer, the learned positions)."""
    cfg = tiny_config(2, 2, 2, "float64", parallel_overrides={"sequence_parallel": True})
    t, b, s, h = 2, cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    m, layers, bsh = cfg.num_microbatches, cfg.model.num_layers // 2, b * s * h
    results = parallel_run(2, 2, 2)
    for res in results:
        sp, plain = res["sp"]["comm"], res["float64"]["comm"]
        pp_rank = res["sp"]["coords"][2]
        first, last = pp_rank == 0, pp_rank == 1
        entries = ("attn_qkv", "mlp_fc1") + (("output",) if last else ())
        exits = ("attn_proj", "mlp_fc2") + (("embedding",) if first else ())
        for tag in entries + exits:
            n = m * (1 if tag in ("output", "embedding") else layers)
            assert _count(sp, "tp", "all_reduce", tag) == (0, 0), tag
            # forward + backward: one all-gather of b*s*h/t per rank and one reduce-scatter of b*s*h
            assert _count(sp, "tp", "all_gather", tag) == (n, n * bsh // t), tag
            assert _count(sp, "tp", "reduce_scatter", tag) == (n, n * bsh), tag
            # the same as the all-reduce it replaces, and the same ring volume
            assert _count(plain, "tp", "all_reduce", tag) == (n, n * bsh), tag
            assert _ring_elements(sp, t, (tag,)) == _ring_elements(plain, t, (tag,)), tag
            regather = _count(sp, "tp", "all_gather", tag + "_regather")
            assert regather == ((n, n * bsh // t) if tag in entries else (0, 0)), tag
        for tag in ("ce_max", "ce_target", "ce_sum_exp", "grad_norm"):
            assert _count(sp, "tp", "all_reduce", tag) == _count(plain, "tp", "all_reduce", tag), tag
        marked = layers * (2 * 2 * h + 2 * h) + (s * h if first else 0) + (2 * h if last else 0)
        assert _count(sp, "tp", "all_reduce", "sequence_parallel") == (1, marked)
        assert (
            _count(sp, "tp", "all_reduce")[0]
            == _count(plain, "tp", "all_reduce")[0] - 4 * layers * m - m * (first + last) + 1
        )
        assert _count(sp, "pp", "send") == (m, m * bsh // t) and _count(sp, "pp", "recv") == (m, m * bsh // t)
        for axis in ("dp", "embedding", "world"):
            assert _count(sp, axis, "all_reduce") == _count(plain, axis, "all_reduce"), axis


def test_post_validation_reduces_the_global_state_in_one_world_all_reduce():
    """--enable-optimizer-post-validation: the gradient norm's square rides the world all-reduce of
    the loss and the skip flags (4 elements instead of 3); the norm's tp and pp all-reduces go;
    every other collective is the synchronous step's."""
    for res in parallel_run(2, 2, 2):
        post, plain = res["postval"]["comm"], res["float64"]["comm"]
        assert _count(post, "world", "all_reduce", "metrics") == (1, 4)
        assert _count(plain, "tp", "all_reduce", "grad_norm") == (1, 1)
        assert _count(post, "tp", "all_reduce", "grad_norm") == _count(post, "pp", "all_reduce", "grad_norm") == (0, 0)
        others = {k: c for k, c in plain.items() if not k.endswith(("/grad_norm", "/metrics"))}
        assert {k: c for k, c in post.items() if not k.endswith("/metrics")} == others
