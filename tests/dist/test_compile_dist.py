"""``--compile`` at tp = 2 (gloo): the compiled layers are split around the tensor-parallel
collectives, which run eagerly and are counted exactly as in eager mode; training equals eager
mode within float32 tolerance."""

from __future__ import annotations

import pytest

from helpers.compile_cases import assert_trains_like_eager, compile_worker
from helpers.dist_helpers import run_in_pool


@pytest.mark.slow
def test_compiled_tp2_trains_like_eager_with_the_same_communication():
    results = run_in_pool(compile_worker, 2)
    for res in results:
        assert_trains_like_eager(res)
        comm = res["compiled"]["comm"]  # 4 microbatches x 4 layers: g forward, f backward, per site
        assert [comm[f"tp/all_reduce/{site}"]["calls"] for site in ("attn_qkv", "attn_proj", "mlp_fc1", "mlp_fc2")] == [
            16
        ] * 4
