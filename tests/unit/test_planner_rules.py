"""Planner rules: the same validators as ptdp train's config, plus the planner's own."""

from __future__ import annotations

import pytest

from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster, UnknownGPUError, get_gpu, load_catalog
from ptdp.planner.inputs.models import PRESETS, UnknownModelError, get_model
from ptdp.planner.search.rules import all_rejections

GPT3 = PRESETS["gpt3-175b"]
A100 = Cluster(CATALOG["a100-80gb"], 1024)


def rules_of(layout: Candidate, model=GPT3, cluster=A100) -> dict[str, str]:
    return {r.rule: r.message for r in all_rejections(model, layout, cluster)}


def test_published_layout_breaks_no_rule():
    assert rules_of(Candidate.of(8, 16, 8, 1, 1536, virtual_stages=2)) == {}


@pytest.mark.parametrize(
    "layout,rule,text",
    [
        (
            Candidate.of(64, 16, 1, 1, 1536),
            "heads % tp",
            "num_attention_heads=96 is not divisible by tensor_model_parallel_size=64",
        ),
        (Candidate.of(16, 8, 8, 1, 1536), "tp crosses nodes", "tp=16 crosses nodes (8 GPUs per node)"),
        (
            Candidate.of(8, 128, 1, 1, 1536),
            "layers % pp",
            "pipeline_model_parallel_size=128 is more stages than num_layers=96",
        ),
        (
            Candidate.of(8, 64, 1, 1, 1536),
            "layers % pp",
            "num_layers=96 is not divisible by pipeline_model_parallel_size=64",
        ),
        (
            Candidate.of(8, 16, 8, 5, 1536),
            "B % (b * dp)",
            "global_batch_size=1536 is not divisible by micro_batch_size*dp = 5*8 = 40",
        ),
        (
            Candidate.of(8, 16, 8, 1, 1536, virtual_stages=4),
            "interleaving",
            "num_layers=96 is not divisible by pp*v = 16*4 = 64",
        ),
        (
            Candidate.of(8, 16, 8, 16, 1536, virtual_stages=2),
            "interleaving",
            "the interleaved-1f1b schedule needs num_microbatches % pp == 0: num_microbatches=12",
        ),
        (Candidate.of(8, 16, 4, 1, 1536), "gpus", "tp*pp*dp = 8*16*4 = 512 != 1024 GPUs"),
    ],
)
def test_each_rule_names_its_numbers(layout, rule, text):
    found = rules_of(layout)
    assert rule in found, found
    assert text in found[rule]


def test_sequence_parallel_rule():
    assert rules_of(Candidate.of(8, 16, 8, 1, 1536, sequence_parallel=True)) == {}
    assert "got 1" in rules_of(Candidate.of(1, 16, 64, 1, 1536, sequence_parallel=True))["sequence parallel"]
    found = rules_of(Candidate.of(3, 16, 8, 1, 1536, sequence_parallel=True))
    assert "seq_length=2048 is not divisible by tensor_model_parallel_size=3" in found["sequence parallel"]


def test_grouped_query_heads_rule():
    llama = get_model("llama2-70b")  # 8 key/value heads
    found = rules_of(Candidate.of(16, 1, 64, 1, 1024), model=llama)
    assert "num_query_groups=8 is not divisible by tp=16" in found["kv heads % tp"]


def test_catalog_lookup_and_user_file(tmp_path):
    assert get_gpu("A100-80GB").memory_bytes == 80 * 1024**3
    with pytest.raises(UnknownGPUError, match="unknown GPU 'r200'.*a100-80gb"):
        get_gpu("r200")
    with pytest.raises(UnknownModelError, match="unknown model 'gpt5'"):
        get_model("gpt5")
    f = tmp_path / "gpus.toml"
    f.write_text(
        "[my-gpu]\npeak_flops = { bf16 = 400e12 }\nmemory_bytes = 48e9\nmemory_bandwidth = 1e12\n"
        "nvlink_bandwidth = 0\nnetwork_bandwidth = 12.5e9\ngpus_per_node = 4\n"
    )
    catalog = load_catalog(f)
    assert catalog["my-gpu"].gpus_per_node == 4 and catalog["my-gpu"].peak("bf16") == 400e12
    f.write_text("[bad]\npeak_flops = { bf16 = 1.0 }\n")
    with pytest.raises(ValueError, match="missing fields"):
        load_catalog(f)
