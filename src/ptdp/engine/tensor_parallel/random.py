"""Random numbers for dropout under tensor, pipeline, context and data parallelism.

:class:`DropoutRNG` holds one rank's dropout generators (never torch's default one), each a
*stream* seeded from ``--seed``, the dp rank, the iteration of the last reseed and its name:

- **replicated** ``<key>``: the same on every tp rank, for activations every tp rank holds whole.
- **tp-distinct** ``<key>/tp<r>``: for activations split over tp, e.g. by sequence parallelism
  (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2).
- **per head** ``<key>/head<j>``: one per global attention head ``j`` (probabilities ``[b, a/tp, s, s]``).
- **whole-sequence** (cp > 1): the replicated stream draws the whole ``[s, b, h]`` mask and the
  rank keeps its rows (:func:`~ptdp.engine.context_parallel.load_balance.rank_positions`).

Keys are ``embedding`` and ``layer.<i>`` (global layer index), so masks are the same at every tp
(without sequence parallelism), cp, pp, schedule and recompute setting; they depend on dp.
:meth:`DropoutRNG.checkpoint_contexts` replays them in recomputation (``torch.utils.checkpoint``'s
``preserve_rng_state`` covers only the default generators).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib

import torch
from torch import nn

from ptdp.engine.context_parallel.load_balance import rank_positions

REPLICATED = "replicated"
TP_DISTINCT = "tp-distinct"
WHOLE_SEQUENCE = "whole-sequence"
STREAMS = (REPLICATED, TP_DISTINCT, WHOLE_SEQUENCE)


class DropoutRNG:
    """This rank's dropout streams (module docstring); no communication.

    ``seed``: ``--seed``; ``dp_rank``: in every stream's seed; ``tp_rank``: in the tp-distinct
    seeds; ``device``: where masks are drawn. ``sequence_parallel`` (cp = 1): hidden dropout draws
    from the tp-distinct streams; ``cp_size > 1``: from the whole-sequence kind, keeping the rows of
    ``cp_rank`` (and, with sequence parallelism, of its block of ``tp_size``). ``recording``: a
    list receiving ``(stream name, boolean drop mask)`` at every draw, or None.
    """

    def __init__(
        self,
        seed: int,
        *,
        dp_rank: int = 0,
        tp_rank: int = 0,
        device: torch.device | str = "cpu",
        sequence_parallel: bool = False,
        cp_rank: int = 0,
        cp_size: int = 1,
        tp_size: int = 1,
    ) -> None:
        self.seed, self.dp_rank, self.tp_rank = seed, dp_rank, tp_rank
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.row_split = tp_size if sequence_parallel else 1
        """How many ranks split a cp rank's rows (tp with sequence parallelism, else 1)."""
        if cp_size > 1:
            self.hidden_stream = WHOLE_SEQUENCE
        else:
            self.hidden_stream = TP_DISTINCT if sequence_parallel else REPLICATED
        """The stream kind of the hidden states' masks."""
        self._rows: dict[int, torch.Tensor] = {}
        self.device = torch.device(device)
        self.reseed_iteration = 0
        self.recording: list[tuple[str, torch.Tensor]] | None = None
        self._generators: dict[str, torch.Generator] = {}

    def stream_seed(self, name: str) -> int:
        text = f"ptdp-dropout/{self.seed}/{self.reseed_iteration}/dp{self.dp_rank}/{name}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 2**63

    def generator(self, name: str) -> torch.Generator:
        """The stream ``name``, seeded on first use."""
        gen = self._generators.get(name)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(self.stream_seed(name))
            self._generators[name] = gen
        return gen

    def stream_name(self, key: str, stream: str) -> str:
        if stream in (REPLICATED, WHOLE_SEQUENCE):
            return key
        if stream == TP_DISTINCT:
            return f"{key}/tp{self.tp_rank}"
        raise ValueError(f"stream={stream!r} must be one of {STREAMS}")

    def dropout(self, x: torch.Tensor, p: float, key: str, *, stream: str = REPLICATED) -> torch.Tensor:
        """``x`` with each element zeroed with probability ``p`` and the rest scaled by
        ``1 / (1 - p)``, the mask drawn for the whole local tensor from stream ``key`` of kind
        ``stream`` (whole-sequence: ``x`` is ``[n, ...]``, this rank's rows of a sequence of
        ``n C`` or ``n C t`` rows, and the mask is drawn for all of them and cut to this rank's
        rows). Backward keeps the 1-byte mask."""
        name = self.stream_name(key, stream)
        if stream == WHOLE_SEQUENCE:
            rows = self.rows(x.shape[0])
            whole = _uniform(
                (x.shape[0] * self.cp_size * self.row_split, *x.shape[1:]), self.generator(name), self.device
            )
            drop = whole.index_select(0, rows) < p
        else:
            drop = _uniform(x.shape, self.generator(name), self.device) < p
        self._record(name, drop)
        return _apply(x, drop, p)

    def rows(self, n: int) -> torch.Tensor:
        """The global positions of this rank's ``n`` hidden-state rows (int64 ``[n]``, cached)."""
        rows = self._rows.get(n)
        if rows is None:
            rows = rank_positions(
                n * self.cp_size * self.row_split,
                self.cp_rank,
                self.cp_size,
                tp_rank=self.tp_rank if self.row_split > 1 else 0,
                tp_size=self.row_split,
                device=self.device,
            )
            self._rows[n] = rows
        return rows

    def head_dropout(self, probs: torch.Tensor, p: float, key: str, *, first_head: int) -> torch.Tensor:
        """Dropout of attention probabilities ``[b, heads, s_q, s_k]`` whose local head ``i`` is
        global head ``first_head + i``: each head's mask ``[b, s_q, s_k]`` comes from its own
        stream ``<key>/head<j>``."""
        b, heads, s_q, s_k = probs.shape
        return _apply(probs, self.head_masks(b, s_q, s_k, p, key, first_head=first_head, heads=heads), p)

    def head_masks(
        self,
        b: int,
        s_q: int,
        s_k: int,
        p: float,
        key: str,
        *,
        first_head: int,
        heads: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The drop masks (True: dropped) of the attention probabilities of ``heads`` local heads,
        global heads ``first_head ..``: bool ``[b, heads, s_q, s_k]``, head ``j``'s ``[b, s_q, s_k]``
        drawn from stream ``<key>/head<j>`` one head at a time. ``rows`` (int64 query positions):
        keep only these rows, ``[b, heads, len(rows), s_k]`` (context parallelism: a rank's rows of
        the whole sequence's masks, the same numbers drawn)."""
        masks = []
        for i in range(heads):
            name = f"{key}/head{first_head + i}"
            draw = _uniform((b, s_q, s_k), self.generator(name), self.device)
            drop = (draw if rows is None else draw.index_select(1, rows)) < p
            self._record(name, drop)
            masks.append(drop)
        return torch.stack(masks, dim=1)

    def _record(self, name: str, drop: torch.Tensor) -> None:
        if self.recording is not None:
            self.recording.append((name, drop.detach().clone()))

    # -- state: recompute and checkpoints -------------------------------------------------------

    def get_states(self) -> dict[str, torch.Tensor]:
        """Every stream's state (copies)."""
        return {name: gen.get_state() for name, gen in self._generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Put every stream back to ``states``; a stream not in it did not exist then and starts
        afresh at its next use."""
        for name in [n for n in self._generators if n not in states]:
            del self._generators[name]
        for name, state in states.items():
            self.generator(name).set_state(state)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the
        forward context saves the streams' states as the region first runs; the recompute
        context sets them for the recompute, which therefore draws the same masks, and then
        restores the states the streams had reached (later microbatches may have drawn since)."""
        saved: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def first_forward():
            saved.update(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute():
            reached = self.get_states()
            self.set_states(saved)
            try:
                yield
            finally:
                self.set_states(reached)

        return first_forward(), recompute()

    def reseed(self, iteration: int) -> None:
        """Start every stream afresh from seeds that include ``iteration`` (a run resumed without
        its saved dropout state draws new masks, not those of the first iterations again)."""
        self.reseed_iteration = iteration
        self._generators.clear()

    def state_dict(self) -> dict:
        """JSON-serialisable state: the reseed iteration and every stream's generator state."""
        return {
            "reseed_iteration": self.reseed_iteration,
            "generators": {
                name: base64.b64encode(state.numpy().tobytes()).decode("ascii")
                for name, state in self.get_states().items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.reseed(int(state["reseed_iteration"]))
        self.set_states(
            {
                name: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
                for name, text in state["generators"].items()
            }
        )


class Dropout(nn.Module):
    """Dropout at one site, with the masks of stream ``key`` of ``rng``; the identity in eval
    mode and when ``p`` is 0 (nothing is drawn then). ``stream``: its kind; None (hidden states):
    ``rng.hidden_stream``, replicated unless the run is sequence or context parallel. Shapes: any
    (whole-sequence: ``[rows, ...]``), output like input."""

    def __init__(self, p: float, rng: DropoutRNG, key: str, *, stream: str | None = None) -> None:
        super().__init__()
        if stream is not None and stream not in STREAMS:
            raise ValueError(f"stream={stream!r} must be one of {STREAMS}")
        self.p, self.rng, self.key, self.stream = p, rng, key, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return self.rng.dropout(x, self.p, self.key, stream=self.stream or self.rng.hidden_stream)

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key!r}, stream={self.stream or 'hidden'}"


def _uniform(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device).uniform_(generator=gen)


def _apply(x: torch.Tensor, drop: torch.Tensor, p: float) -> torch.Tensor:
    # masked_fill keeps only the boolean mask for backward, the scaling by a number nothing
    return x.masked_fill(drop, 0.0) * (1.0 / (1.0 - p))
