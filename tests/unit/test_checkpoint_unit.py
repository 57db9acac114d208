"""Checkpoints, in this process: the note about a 1-bit residual that cannot be restored (saving
and loading at several layouts: tests/dist/test_checkpoint.py)."""

from __future__ import annotations


def test_a_one_bit_residual_that_cannot_be_restored_is_warned_about():
    from ptdp.run.checkpoint.folders import residual_note

    layout = {
        "tp": 2,
        "pp": 2,
        "dp": 2,
        "virtual_stages": 1,
        "ddp_bucket_size": None,
        "use_distributed_optimizer": False,
        "pipeline_layer_split": None,
    }
    meta = {"grad_compression": "1bit", "layout": layout, "world_size": 8, "restored": {"residual": False}}
    note = residual_note(meta, dict(layout, dp=1, pp=4), 8, "1bit")
    assert note.startswith(
        "the checkpoint's 1-bit error-feedback residual cannot be restored at another layout "
        "(pp 2 -> 4, dp 2 -> 1): it starts again from zero"
    )
    assert "--grad-compression none" in residual_note(meta, layout, 8, "none")
    assert residual_note(dict(meta, restored={"residual": True}), layout, 8, "1bit") is None
    assert residual_note(dict(meta, grad_compression="none"), dict(layout, dp=1), 4, "1bit") is None
    # cp is in a layout only when > 1: going from cp 2 to cp 1 names it
    note = residual_note(dict(meta, layout=dict(layout, cp=2, dp=1)), layout, 8, "1bit")
    assert "(dp 1 -> 2, cp 2 -> 1)" in note, note
