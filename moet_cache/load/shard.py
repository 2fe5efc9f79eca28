"""A rank's share of every routed expert, and the byte runs of a tensor that hold it (pure, no I/O).

Under tensor parallelism rank r of N holds, of every expert, the columns r*I/N .. (r+1)*I/N of the
expert width I: w13's gate rows and up rows of that range (vLLM's FusedMoE shards w13 so: gate and up
each split on their output rows), w2's input columns of it; block-scale groups stay whole, since I/N
is a multiple of 32 (NVFP4 groups 16 weights, MXFP4 and the compact e8m0 form 32). Under expert
parallelism a rank holds whole experts, those vLLM's `expert_map` gives it, in its local order. Both
may combine; the per-expert tensors (scale_2, tables, input scales) are read for the rank's experts
whole.

A row-major tensor's share is a few regular runs of bytes (`Run`: `count` pieces of `piece` bytes,
`stride` apart), so a rank reads exactly its bytes: w13's share of an expert is two pieces (gate, up),
w2's one piece a row of H rows, and consecutive experts continue the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cache import layout as L
from ..errors import InputError

#: the expert width a rank holds is a multiple of this: whole block-scale groups in both scale forms (16
#: weights an e4m3 scale, 32 an e8m0 one) and whole plane bytes (4 codes a byte)
TP_WIDTH_UNIT = 32

#: tensors split on their rows (w13: gate rows then up rows) and on their input columns (w2) under TP
TP_ROWS = frozenset({L.W13_BASE, L.W13_SCALE, L.W13_DELTA})
TP_COLUMNS = frozenset({L.W2_BASE, L.W2_SCALE, L.W2_DELTA})


@dataclass(frozen=True)
class Shard:
    """What one rank holds: `experts` (global ids in the rank's local order; None: every expert) and the
    tensor-parallel slice `tp_rank` of `tp_size` of each expert's width."""

    experts: tuple[int, ...] | None = None
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if type(self.tp_size) is not int or type(self.tp_rank) is not int or self.tp_size < 1 \
                or not 0 <= self.tp_rank < self.tp_size:
            raise InputError(f"tensor-parallel rank {self.tp_rank!r} of {self.tp_size!r} is not a rank")
        if self.experts is not None:
            if not all(type(e) is int and e >= 0 for e in self.experts):
                raise InputError(f"a shard's experts must be expert ids, got {list(self.experts)!r}")
            if len(set(self.experts)) != len(self.experts):
                raise InputError("a shard names an expert twice")

    @property
    def whole(self) -> bool:
        """The whole layer: every expert, its full width."""
        return self.experts is None and self.tp_size == 1

    def expert_ids(self, n_experts: int) -> tuple[int, ...]:
        """The global ids of the rank's experts, in local order, for a layer of n_experts."""
        if self.experts is None:
            return tuple(range(n_experts))
        bad = [e for e in self.experts if e >= n_experts]
        if bad:
            raise InputError(f"the shard names expert {bad[0]}, the layer has {n_experts}")
        return self.experts

    def width(self, inter: int) -> tuple[int, int]:
        """(first, end) of the rank's columns of an expert `inter` wide; refuses a width that does not
        split into whole block-scale groups."""
        if inter % self.tp_size or (inter // self.tp_size) % TP_WIDTH_UNIT:
            raise InputError(f"tensor parallelism {self.tp_size} splits an expert width of {inter} into "
                             f"{inter / self.tp_size:g} columns, not a multiple of {TP_WIDTH_UNIT} (whole "
                             "block-scale groups)", f"use a tensor-parallel size that divides {inter} into "
                             f"multiples of {TP_WIDTH_UNIT}, or expert parallelism")
        part = inter // self.tp_size
        return self.tp_rank * part, (self.tp_rank + 1) * part


@dataclass(frozen=True)
class Run:
    """`count` pieces of `piece` bytes at first, first + stride, ... (offsets from the tensor's first byte)."""

    first: int
    piece: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.piece * self.count

    @property
    def end(self) -> int:
        """One past the last byte it reads."""
        return self.first + (self.count - 1) * self.stride + self.piece if self.count else self.first


def _merge(runs: list[Run]) -> tuple[Run, ...]:
    """Runs that continue one another joined, and a run without gaps made one piece."""
    out: list[Run] = []
    for r in runs:
        if r.count == 0 or r.piece == 0:
            continue
        if r.count == 1:
            r = Run(r.first, r.piece, r.piece, 1)
        last = out[-1] if out else None
        if last is not None and last.piece == r.piece and last.stride == r.stride \
                and last.first + last.count * last.stride == r.first:
            out[-1] = Run(last.first, last.piece, last.stride, last.count + r.count)
        elif last is not None and last.count == 1 and r.count == 1 and last.end == r.first:
            out[-1] = Run(last.first, last.piece + r.piece, last.piece + r.piece, 1)
        else:
            out.append(r)
    return tuple(Run(r.first, r.nbytes, r.nbytes, 1) if r.piece == r.stride else r for r in out)


def share(name: str, shape: Sequence[int], itemsize: int, rows: Sequence[int], width: tuple[int, int],
          inter: int) -> tuple[tuple[int, ...], tuple[Run, ...]]:
    """(shape handed out, byte runs) of a rank's share of tensor `name` [n, ...] stored row-major with
    `itemsize`-byte elements: its rows `rows` (experts, or tier rows) in that order, and of the TP_ROWS and
    TP_COLUMNS tensors the columns `width` of an expert `inter` wide."""
    row_bytes = itemsize
    for d in shape[1:]:
        row_bytes *= d
    lo, hi = width
    if name in TP_ROWS and (lo, hi) != (0, inter):  # [n, 2I, K]: gate rows lo..hi, then up rows I+lo..I+hi
        line = row_bytes // shape[1]
        within = [Run(lo * line, (hi - lo) * line, inter * line, 2)]
        out_shape = (len(rows), 2 * (hi - lo), *shape[2:])
    elif name in TP_COLUMNS and (lo, hi) != (0, inter):  # [n, H, cols]: each row's columns of lo..hi
        cols = shape[2]
        a, b = lo * cols // inter, hi * cols // inter
        within = [Run(a * itemsize, (b - a) * itemsize, cols * itemsize, shape[1])]
        out_shape = (len(rows), shape[1], b - a)
    else:
        within = [Run(0, row_bytes, row_bytes, 1)]
        out_shape = (len(rows), *shape[1:])
    runs = [Run(e * row_bytes + w.first, w.piece, w.stride, w.count) for e in rows for w in within]
    return out_shape, _merge(runs)


def windows(runs: Sequence[Run], pos: int, n: int) -> list[tuple[Run, int, int, int]]:
    """Bytes [pos, pos + n) of the runs' pieces read one after another, as (run, first piece, bytes to skip
    in it, bytes taken from this run): one regular stretch of pieces per run."""
    out: list[tuple[Run, int, int, int]] = []
    for r in runs:
        if n <= 0:
            break
        if pos >= r.nbytes:
            pos -= r.nbytes
            continue
        k, skip = divmod(pos, r.piece)
        take = min(n, r.nbytes - pos)
        out.append((r, k, skip, take))
        n -= take
        pos = 0
    return out


__all__ = ["Run", "Shard", "TP_COLUMNS", "TP_ROWS", "TP_WIDTH_UNIT", "share", "windows"]
