"""What one rank sends to move an MoE layer's tokens to its experts and back, per micro-batch, on
each axis and tag of ``ptdp.engine.comm`` (docs/architecture.md, Communication of one step): the
inputs of the all-to-all time of an MoE layer.

``rows``: the routed rows this rank sends, ``A``: its kept assignments (dropless ``k T``), or with
expert inputs padded to the capacity ``E C``. Loads are balanced: every rank receives as many rows
as it sends (exact with padding or forced balance, else the mean; Megatron-Core's published MoE
tables force it). ``G = ep etp``.

- alltoall: the ``E`` counts (int64; none when padded), ``moe_dispatch`` and ``moe_combine`` ``A h``
  each, and in backward ``moe_combine_grad`` and ``moe_dispatch_grad`` the same; with etp > 1 also
  the ep counts gathered over etp (``E``), each received row to every etp peer
  (``moe_etp_gather`` ``etp A h``) and the partial outputs of every peer's rows back
  (``moe_etp_scatter`` ``etp A h``), and their ``_grad`` in backward.
- allgather: the counts gathered over the G ranks (``E``; none when padded), every rank's rows to
  every peer (``moe_allgather`` ``G A h``) and the outputs back (``moe_reduce_scatter`` ``G A h``),
  and their ``_grad``.
"""

from __future__ import annotations


def moe_exchange_elements(
    rows: int,
    hidden: int,
    num_experts: int,
    *,
    ep: int,
    etp: int = 1,
    dispatcher: str = "alltoall",
    padded: bool = False,
) -> dict[str, int]:
    """``{"<axis>/<op>/<tag>": elements}`` one rank sends for one MoE layer and micro-batch, forward
    and backward (module docstring); empty at ep = etp = 1. Raises ValueError for an unknown
    ``dispatcher``."""
    if ep * etp == 1:
        return {}
    out: dict[str, int] = {}
    if dispatcher == "allgather":
        group = ep * etp
        if not padded:
            out["ep/all_gather/moe_counts"] = num_experts
        for tag in ("moe_allgather", "moe_reduce_scatter", "moe_allgather_grad", "moe_reduce_scatter_grad"):
            out[f"ep/all_to_all/{tag}"] = group * rows * hidden
        return out
    if dispatcher != "alltoall":
        raise ValueError(f"dispatcher={dispatcher!r} must be alltoall or allgather")
    if ep > 1:
        if not padded:
            out["ep/all_to_all/moe_counts"] = num_experts
        for tag in ("moe_dispatch", "moe_combine", "moe_combine_grad", "moe_dispatch_grad"):
            out[f"ep/all_to_all/{tag}"] = rows * hidden
    if etp > 1:
        if not padded:
            out["etp/all_gather/moe_counts"] = num_experts
        for tag in ("moe_etp_gather", "moe_etp_scatter", "moe_etp_gather_grad", "moe_etp_scatter_grad"):
            out[f"etp/all_to_all/{tag}"] = etp * rows * hidden
    return out
