"""The chunked output layer + cross entropy on the padded vocabulary at tp = 1 (tp = 2 and 4, with
and without sequence parallelism: tests/dist/test_tensor_parallel.py): equal to
``F.cross_entropy(F.linear(x, real rows))`` in float64, and never holding the whole microbatch's
logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.tp_cases import CHUNKS, IGNORED, VOCAB, ce_labels, inputs, linear_ce_reference, padded_output_weight
from ptdp.config.model import ModelConfig
from ptdp.engine.activation_meter import SavedActivationMeter, parameter_storages
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.tensor_parallel.linear_cross_entropy import default_chunk_tokens, linear_cross_entropy
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.layout.vocab import keeps_logits

TOL = dict(rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("keep", [None, True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_matches_cross_entropy_of_the_real_vocabulary(chunk, keep):
    """Nonzero padding rows: masked to -inf, they change neither the loss nor any gradient, and
    get none themselves; ignored labels give loss 0 and no gradient. With the logits kept for
    backward or recomputed (None: kept when no chunk size is given)."""
    d = inputs()
    ref = linear_ce_reference(d["x"], d["ids"])
    x = d["x"].clone().requires_grad_()
    w = padded_output_weight(d).requires_grad_()
    tp = ParallelGroups.single_process().tp
    loss = linear_cross_entropy(
        x, w, ce_labels(d["ids"]), vocab_start=0, vocab_size=VOCAB, axis=tp, chunk_tokens=chunk, keep_logits=keep
    )
    loss.sum().backward()
    torch.testing.assert_close(loss, ref["loss"], **TOL)
    torch.testing.assert_close(x.grad, ref["x_grad"], **TOL)
    torch.testing.assert_close(w.grad, ref["w_grad"], **TOL)
    assert torch.all(w.grad[VOCAB:] == 0) and all(loss[pos] == 0 for pos in IGNORED)
    assert all(torch.all(x.grad[pos] == 0) for pos in IGNORED)


def test_rejects_bad_labels_and_chunks():
    d, tp = inputs(), ParallelGroups.single_process().tp
    target = d["ids"].clone()
    target[1, 1] = VOCAB
    with pytest.raises(ValueError, match=f"label {VOCAB} at position \\(1, 1\\) is outside the vocabulary"):
        linear_cross_entropy(d["x"], padded_output_weight(d), target, vocab_start=0, vocab_size=VOCAB, axis=tp)
    with pytest.raises(ValueError, match="chunk_tokens=0 must be at least 1"):
        linear_cross_entropy(
            d["x"], padded_output_weight(d), d["ids"], vocab_start=0, vocab_size=VOCAB, axis=tp, chunk_tokens=0
        )


def test_default_chunk_keeps_a_chunk_of_float32_logits_under_256_mib():
    assert default_chunk_tokens(50304) == 1280 and 1280 * 50304 * 4 <= 2**28
    assert default_chunk_tokens(10**9) == 64 and default_chunk_tokens(32) % 64 == 0


def test_logits_are_kept_up_to_256_mib_in_the_compute_dtype():
    """GPT-2's padded vocabulary at tp = 1: one 2,048-token bf16 sequence's logits (206 MB) are
    kept, 2,669 tokens' (268.6 MB) are not; float32 halves the tokens; tp = 2 doubles them."""
    assert keeps_logits(2048, 50304, 2) and 2668 * 50304 * 2 <= 2**28
    assert not keeps_logits(2669, 50304, 2)
    assert keeps_logits(1334, 50304, 4) and not keeps_logits(1335, 50304, 4)
    assert keeps_logits(2 * 2668, 50304 // 2, 2) and not keeps_logits(2 * 2669, 50304 // 2, 2)


def _tiny_model(untied: bool, vocab: int = 301, dtype: str = "float64") -> GPTModel:
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=6,
        vocab_size=vocab,
        make_vocab_size_divisible_by=64,
        params_dtype=dtype,
        untie_embeddings_and_output_weights=untied,
    )
    model = GPTModel(cfg, ParallelGroups.single_process().tp, layer_ids=range(1), pre_process=True, post_process=True)
    initialize_parameters(model, seed=3, std=0.02, num_layers=1, tp_rank=0, tp_size=1)
    return model


def _batch(vocab: int, b: int = 3, s: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens, labels = torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)
    labels[0, 2] = labels[2, -1] = -100
    return tokens, labels


@pytest.mark.parametrize("untied", [False, True])
def test_model_loss_and_gradients_equal_the_plain_output_layer(untied):
    """The model's loss (tied and untied output layer, 4 chunks of 5 tokens and one of 2) and every
    parameter's gradient equal a plain ``F.linear`` on the real rows + ``F.cross_entropy``."""
    model = _tiny_model(untied)
    model.loss_chunk_tokens = 5
    tokens, labels = _batch(301)
    model(tokens, labels).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = model.output_layer if untied else model.word_embeddings
    assert out.weight.shape[0] == 320, "the GEMM runs on the padded width"
    x = model.final_norm(model.layers["0"](model.embed(tokens))).transpose(0, 1)  # [s, b, h] -> [b, s, h]
    want = F.cross_entropy(F.linear(x, out.real_weight()).flatten(0, 1), labels.flatten())  # mean over kept
    want.backward()
    torch.testing.assert_close(model(tokens, labels), want.detach(), **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, **TOL, msg=lambda m: f"{name}: {m}")
    assert torch.all(got["output_layer.weight" if untied else "word_embeddings.weight"][301:] == 0)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator produced while active, except tensors of the
    weight's shape ``skip`` or its transpose (the weight's views and gradient)."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__()
        self.largest, self.skip = 0, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in (self.skip, self.skip[::-1]):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_microbatch_logits_are_never_held(dtype):
    """b s = 64 tokens, V_pad = 1024, chunks of 8 tokens: no operator in forward or backward of the
    output layer + loss makes a tensor of more than 8 x 1024 elements (the whole microbatch's
    logits are 64 x 1024; the weight's views and gradient aside), and what autograd keeps is the
    input ``[b s, h]``, the labels and one float32 log-sum-exp per token, far below the 256 KiB of float32 logits the plain
    linear + ``F.cross_entropy`` keeps (measured here too)."""
    model = _tiny_model(untied=True, vocab=1000, dtype=dtype)
    model.loss_chunk_tokens = 8
    tokens, labels = _batch(1000, b=16, s=4)
    x = model.final_norm(model.layers["0"](model.embed(tokens))).detach().requires_grad_()
    n, h, v_pad = 64, 16, 1024
    meter, largest = SavedActivationMeter(parameter_storages(model)), _LargestTensor((v_pad, h))
    with meter.hooks(), largest:
        loss = model.token_losses(x, labels)
        loss.sum().backward()
    elem = x.element_size()
    assert largest.largest <= 8 * v_pad < n * v_pad
    assert meter.peak == n * h * elem + n * 8 + n * 4  # input, int64 labels, float32 log-sum-exp
    plain = SavedActivationMeter(parameter_storages(model))
    with plain.hooks():
        logits = F.linear(x, model.output_layer.real_weight()).float()
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    assert plain.peak >= n * 1000 * 4 > 8 * meter.peak


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_microbatch_keeps_its_logits_in_the_compute_dtype(dtype):
    """Without a chunk size, b s = 64 tokens x V_pad = 1024 (far under 256 MiB): autograd keeps
    the input, the labels, the float32 log-sum-exp and the logits in the compute dtype
    (``keeps_logits``, the planner's rule), and backward runs no third GEMM: two ``mm`` of the
    logits' size in backward against three when recomputing."""
    model = _tiny_model(untied=True, vocab=1000, dtype=dtype)
    tokens, labels = _batch(1000, b=16, s=4)
    x = model.final_norm(model.layers["0"](model.embed(tokens))).detach().requires_grad_()
    n, h, v_pad, elem = 64, 16, 1024, x.element_size()
    counts = {}
    for keep in (None, False):
        model.loss_keep_logits = keep
        meter, gemms = SavedActivationMeter(parameter_storages(model)), _GemmCounter()
        with meter.hooks():
            loss = model.token_losses(x, labels)
        with gemms:
            loss.sum().backward()
        counts[keep] = gemms.count
        extra = n * v_pad * elem if keep is None else 0
        assert meter.peak == n * h * elem + n * 8 + n * 4 + extra
    assert counts == {None: 2, False: 3}


class _GemmCounter(TorchDispatchMode):
    """How many matrix products ran while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _bf16_case(device: str) -> None:
    """bfloat16 input and weight (V_pad = 1024 with 24 padding rows, 3 chunks of 40 tokens): the
    float32 loss and the bf16 gradients are as close to the float64 computation from the same bf16
    values as the plain bf16 output layer + float32 ``F.cross_entropy`` is (within 1.5 times its
    largest error, plus 1e-3)."""
    g = torch.Generator().manual_seed(9)
    x64 = torch.randn(4, 30, 64, generator=g, dtype=torch.float64)
    w64 = 0.3 * torch.randn(1024, 64, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 1000, (4, 30), generator=g)
    labels[1, 3] = -100

    def run(dtype, fused: bool):
        x = x64.to(torch.bfloat16).to(dtype).to(device).requires_grad_()
        w = w64.to(torch.bfloat16).to(dtype).to(device).requires_grad_()
        if fused:
            loss = linear_cross_entropy(
                x,
                w,
                labels.to(device),
                vocab_start=0,
                vocab_size=1000,
                axis=ParallelGroups.single_process().tp,
                chunk_tokens=40,
            )
            assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        else:
            logits = F.linear(x, w[:1000]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten(), reduction="none").view(4, 30)
        loss.sum().backward()
        return [t.detach().cpu().double() for t in (loss, x.grad, w.grad)]

    exact = run(torch.float64, fused=False)
    plain, fused = run(torch.bfloat16, fused=False), run(torch.bfloat16, fused=True)
    for name, want, p, f in zip(("loss", "x grad", "w grad"), exact, plain, fused):
        plain_err, fused_err = float((p - want).abs().max()), float((f - want).abs().max())
        assert fused_err <= 1.5 * plain_err + 1e-3, (name, fused_err, plain_err)
    assert torch.all(fused[2][1000:] == 0)


def test_bfloat16_matches_float64_within_bf16_rounding():
    _bf16_case("cpu")


@pytest.mark.gpu
def test_bfloat16_on_cuda_matches_float64_within_bf16_rounding():
    _bf16_case("cuda")


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_compiled_chunks_match_cross_entropy_of_the_real_vocabulary(keep):
    """``compiled=True`` (``--compile``): each chunk's statistics and gradient run through
    ``torch.compile`` (inductor) and still equal the float64 reference at 1e-9, chunks of 5 tokens
    (an uneven last chunk) with nonzero padding rows and ignored labels, the logits recomputed or
    kept."""
    from torch._dynamo.utils import counters

    d = inputs()
    ref = linear_ce_reference(d["x"], d["ids"])
    x = d["x"].clone().requires_grad_()
    w = padded_output_weight(d).requires_grad_()
    counters.clear()
    loss = linear_cross_entropy(
        x,
        w,
        ce_labels(d["ids"]),
        vocab_start=0,
        vocab_size=VOCAB,
        axis=ParallelGroups.single_process().tp,
        chunk_tokens=5,
        compiled=True,
        keep_logits=keep,
    )
    loss.sum().backward()
    assert counters["stats"]["unique_graphs"] >= 2, "statistics and gradient compiled"
    torch.testing.assert_close(loss, ref["loss"], **TOL)
    torch.testing.assert_close(x.grad, ref["x_grad"], **TOL)
    torch.testing.assert_close(w.grad, ref["w_grad"], **TOL)
