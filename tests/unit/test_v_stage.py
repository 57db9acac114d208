"""A rank running both ends of the V placement (pp = 1 here: chunk 0 is stage 0, chunk 1 stage 1)
holds one tied embedding, used by both chunks, named once, reduced with no embedding group."""

from __future__ import annotations

from helpers.layout_cases import tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage


def test_one_rank_holds_one_tied_embedding():
    cfg = tiny_config(1, 1, 1, "float64", parallel_overrides={"pipeline_schedule": "zb-v"})
    stage = build_stage(cfg, ParallelGroups.single_process())
    first, last = stage.model
    assert (first.pre_process, first.post_process, last.pre_process, last.post_process) == (True, False, False, True)
    assert last.word_embeddings.weight is first.word_embeddings.weight
    names = [name for name, _ in global_named_parameters(stage.model)]
    assert len(names) == len(set(names)) and names.count("word_embeddings.weight") == 1
    assert stage.model.tied_embedding() is None  # no copy elsewhere to sum with
    assert sum(p.numel() for p in stage.grads.params) == sum(p.numel() for p in stage.model.parameters())


def test_untied_v_keeps_its_output_layer():
    cfg = tiny_config(
        1, 1, 1, "float64", parallel_overrides={"pipeline_schedule": "zb-v"}, untie_embeddings_and_output_weights=True
    )
    first, last = build_stage(cfg, ParallelGroups.single_process()).model
    assert not hasattr(last, "word_embeddings") and last.output_layer.weight is not first.word_embeddings.weight
