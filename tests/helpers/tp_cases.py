"""Inputs, label cases and single-process references of the tensor-parallel building-block tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptdp.engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

B, S, H, VOCAB, DIV = 2, 3, 8, 10, 8  # tp=4: padded vocab 32, ranks 2 and 3 hold only padding
S_SP = 4  # sequence-parallel inputs: split over 2 or 4 tp ranks


def inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(B, S, VOCAB, generator=g, dtype=torch.float64),
        "target": torch.randint(0, VOCAB, (B, S), generator=g),
        "grad_loss": torch.randn(B, S, generator=g, dtype=torch.float64),
        "x": torch.randn(B, S, H, generator=g, dtype=torch.float64),
        "w1": torch.randn(4 * H, H, generator=g, dtype=torch.float64),
        "b1": torch.randn(4 * H, generator=g, dtype=torch.float64),
        "w2": torch.randn(H, 4 * H, generator=g, dtype=torch.float64),
        "b2": torch.randn(H, generator=g, dtype=torch.float64),
        "emb": torch.randn(VOCAB, H, generator=g, dtype=torch.float64),
        "ids": torch.randint(0, VOCAB, (B, S), generator=g),
        "xs": torch.randn(B, S_SP, H, generator=g, dtype=torch.float64),
        "ids_sp": torch.randint(0, VOCAB, (B, S_SP), generator=g),
        "ys_grad": torch.randn(B, S_SP, H, generator=g, dtype=torch.float64),
        "cube": torch.randn(4, 4, 4, generator=g, dtype=torch.float64),
        "padding_rows": torch.randn(PADDED - VOCAB, H, generator=g, dtype=torch.float64),
    }


PADDED = 32  # VOCAB padded for tp up to 4 (DIV * 4)
CHUNKS = (1, 5, None)  # tokens per chunk of the linear cross entropy: 1, uneven, one chunk


def padded_output_weight(d: dict) -> torch.Tensor:
    """``[PADDED, H]``: the real rows ``emb`` and *nonzero* padding rows, so that a padding column
    that is not masked out would change the loss."""
    return torch.cat([d["emb"], d["padding_rows"]])


def ce_labels(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with the positions :data:`IGNORED` labelled -100."""
    target = ids.clone()
    for pos in IGNORED:
        target[pos] = -100
    return target


def linear_ce_reference(x: torch.Tensor, ids: torch.Tensor) -> dict:
    """Loss ``[b, s]`` and the gradients of ``x`` and of the padded weight (zero padding rows) of
    ``F.cross_entropy(F.linear(x, real rows))`` (ignored labels), backward of ``loss.sum()``."""
    d = inputs()
    x = x.clone().requires_grad_()
    w = padded_output_weight(d).requires_grad_()
    logits = F.linear(x, w[:VOCAB])
    loss = F.cross_entropy(logits.flatten(0, 1), ce_labels(ids).flatten(), reduction="none").view(ids.shape)
    loss.sum().backward()
    return {"loss": loss.detach(), "x_grad": x.grad, "w_grad": w.grad}


IGNORED = ((0, 1), (1, 0), (1, 2))  # positions labelled -100
BAD_LABELS = (VOCAB, VOCAB + 5, -1, -101)


def label_cases(tp, d: dict, vocab_start: int, num_real: int) -> dict:
    """The cross entropy with ignored labels (-100: loss 0, no gradient), and the error of each
    out-of-range label, on this rank's vocabulary slice (tp = 1: ``F.cross_entropy``)."""
    target = d["target"].clone()
    for pos in IGNORED:
        target[pos] = -100
    logits = d["logits"][..., vocab_start : vocab_start + num_real].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, vocab_start=vocab_start, vocab_size=VOCAB, axis=tp)
    loss.backward(d["grad_loss"])
    errors = []
    for bad in BAD_LABELS:
        target = d["target"].clone()
        target[1, 1] = bad
        try:
            vocab_parallel_cross_entropy(
                d["logits"][..., vocab_start : vocab_start + num_real],
                target,
                vocab_start=vocab_start,
                vocab_size=VOCAB,
                axis=tp,
            )
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return {"ignored_loss": loss.detach(), "ignored_logits_grad": logits.grad, "label_errors": errors}


def reference() -> dict:
    d = inputs()
    ref = {}
    w = d["emb"].clone().requires_grad_()
    hidden = F.embedding(d["ids"], w)
    hidden.backward(d["x"])
    ref["embedding"], ref["embedding_grad"] = hidden.detach(), w.grad
    logits = d["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), d["target"].reshape(-1), reduction="none").view(B, S)
    loss.backward(d["grad_loss"])
    ref["loss"], ref["logits_grad"] = loss.detach(), logits.grad
    x = d["x"].clone().requires_grad_()
    w1, w2, b2 = (d[k].clone().requires_grad_() for k in ("w1", "w2", "b2"))
    y = F.linear(F.gelu(F.linear(x, w1, d["b1"])), w2, b2)
    y.backward(torch.ones_like(y))
    ref.update(y=y.detach(), x_grad=x.grad, w1_grad=w1.grad, w2_grad=w2.grad, b2_grad=b2.grad)
    # the sequence-parallel inputs, whole
    w = d["emb"].clone().requires_grad_()
    hidden = F.embedding(d["ids_sp"], w)
    hidden.backward(d["ys_grad"])
    ref["sp_embedding"], ref["sp_embedding_grad"] = hidden.detach(), w.grad
    x = d["xs"].clone().requires_grad_()
    w1, b1, w2, b2 = (d[k].clone().requires_grad_() for k in ("w1", "b1", "w2", "b2"))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(d["ys_grad"])
    ref.update(
        sp_y=y.detach(),
        sp_x_grad=x.grad,
        sp_w1_grad=w1.grad,
        sp_b1_grad=b1.grad,
        sp_w2_grad=w2.grad,
        sp_b2_grad=b2.grad,
    )
    target = d["target"].clone()
    for pos in IGNORED:
        target[pos] = -100
    logits = d["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(B, S)
    loss.backward(d["grad_loss"])
    ref["ignored_loss"], ref["ignored_logits_grad"] = loss.detach(), logits.grad
    x, w = d["xs"].clone().requires_grad_(), d["emb"].clone().requires_grad_()
    loss = F.cross_entropy(F.linear(x, w).reshape(-1, VOCAB), d["ids_sp"].reshape(-1), reduction="none")
    loss.sum().backward()
    ref.update(sp_out_loss=loss.detach().view(B, S_SP), sp_out_x_grad=x.grad, sp_out_w_grad=w.grad)
    return ref


def check_label_cases(results: list[dict]) -> None:
    """Every rank's :func:`label_cases`: ignored labels give loss 0 and no gradient as
    ``F.cross_entropy`` does, each bad label is refused with the same message."""
    ref, tol = reference(), dict(rtol=1e-12, atol=1e-12)
    for res in results:
        torch.testing.assert_close(res["ignored_loss"], ref["ignored_loss"], **tol)
        assert all(res["ignored_loss"][pos] == 0 for pos in IGNORED)
        assert [
            e is not None and f"label {bad} at position (1, 1) is outside the vocabulary [0, {VOCAB})" in e
            for bad, e in zip(BAD_LABELS, res["label_errors"])
        ] == [True] * len(BAD_LABELS)
    grad = torch.cat([r["ignored_logits_grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad, ref["ignored_logits_grad"], **tol)
    assert all(torch.all(grad[pos] == 0) for pos in IGNORED)
