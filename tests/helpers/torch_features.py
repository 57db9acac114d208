"""Skip marks for tests that need something this torch may lack (docs/testing.md#older-torch)."""

from __future__ import annotations

import pytest

from ptdp.engine.tensor_parallel.wgrad import hooks_run_without_grad

#: the fused weight-gradient paths, and the planner's counts of them, need a torch that runs a
#: post-accumulate hook for a parameter no gradient reached
NEEDS_FUSED_WGRAD = pytest.mark.skipif(
    not hooks_run_without_grad(), reason="this torch runs no post-accumulate hook without a gradient"
)
