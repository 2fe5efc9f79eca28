"""Plane maths in torch: unpack 2-bit planes, the two block-scale forms, one expert's weights.

Shared facts (CONTRACT.md fact 2, docs/FORMAT.md): element 4k+j of a plane row sits in bits 2j..2j+1
of byte k; W[o, i] = v(code)[o, i] * float(block_scale[o, i // group]) * scale_2, with
v = table[base] for a base-only expert, E2M1[(base << 2) | delta] for a tier expert and
mid_table[(base << 1) | mid] for a mid-tier expert (the mid plane: one bit a weight). The group is
in_features // block_scale.shape[-1]: 16 for float8_e4m3fn scales, 32 for the compact
float8_e8m0fnu form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import InputError
from .plane_layout import NATURAL, PlaneLayout, moved_rows, to_natural

#: E2M1 value of each 4-bit code (bit 3 sign, bits 0-2 magnitude index).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_SCALE_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def unpack_plane(plane: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/4] plane -> uint8 [..., n] 2-bit codes (element 4k+j from bits 2j..2j+1)."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=plane.device)
    codes = (plane.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(plane.shape[:-1] + (plane.shape[-1] * 4,))


def expand_block_scale(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """Block scales [..., in/group] (e4m3 or e8m0) -> float32 [..., in], each repeated over its group."""
    return scale.float().repeat_interleave(_group(scale, in_features), dim=-1)


def _group(scale: torch.Tensor, in_features: int) -> int:
    """The inputs a block scale of `scale` covers (checked: a float8 scale form, whole groups)."""
    if scale.dtype not in _SCALE_DTYPES:
        raise InputError(f"block scales must be float8_e4m3fn or float8_e8m0fnu, not {scale.dtype}")
    groups = scale.shape[-1]
    if groups == 0 or in_features % groups:
        raise InputError(f"{in_features} input features do not split into {groups} scale groups")
    return in_features // groups


def unpack_mid(plane: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/8] mid plane -> uint8 [..., n] bits (element 8k+j from bit j of byte k)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=plane.device)
    bits = (plane.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(plane.shape[:-1] + (plane.shape[-1] * 8,))


@dataclass(frozen=True)
class MidPlanes:
    """A layer's mid tier as loaded (delta="tier" of a cache with one): m experts' mid planes and tables."""

    w13_mid: torch.Tensor           # uint8 [m, 2I, H/8]
    w2_mid: torch.Tensor            # uint8 [m, H, I/8]
    w13_mid_table: torch.Tensor     # float32 [m, 2, 8] (gate, up), by 3-bit code
    w2_mid_table: torch.Tensor      # float32 [m, 8]
    mid_experts: torch.Tensor       # int64 [m]

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], H: int, I: int) -> "MidPlanes | None":
        """The mid tier of a loaded layer; None when it has no mid tensors (a cache without a mid tier)."""
        if "mid_experts" not in t:
            return None
        idx = t["mid_experts"]
        m = idx.shape[0]
        got = tuple(t.get(n) for n in ("w13_mid", "w2_mid", "w13_mid_table", "w2_mid_table"))
        want = ((m, 2 * I, H // 8), (m, H, I // 8), (m, 2, 8), (m, 8))
        # shapes and dtypes only: the expert numbers are the loader's (reading them would sync the device on
        # every call, which a CUDA graph cannot capture), as delta_experts' are
        if any(g is None or tuple(g.shape) != w for g, w in zip(got, want)) or idx.dim() != 1 \
                or got[0].dtype != torch.uint8 or got[1].dtype != torch.uint8:
            raise InputError("the layer's mid tier does not fit its mid_experts "
                             f"(w13_mid [m, 2I, H/8], w2_mid [m, H, I/8], tables [m, 2, 8] and [m, 8], m = {m})",
                             "pass what Cache.load(..., expand=False) yields")
        return cls(got[0], got[1], got[2].float(), got[3].float(), idx.long())

    def rows(self) -> dict[int, int]:
        """expert -> its row in the mid planes."""
        return {int(e): k for k, e in enumerate(self.mid_experts.tolist())}


@dataclass(frozen=True)
class LayerPlanes:
    """One layer's tensors as `Cache.load(..., expand=False)` yields them, checked and named."""

    w13_base: torch.Tensor          # uint8 [E, 2I, H/4]
    w2_base: torch.Tensor           # uint8 [E, H, I/4]
    w13_scale: torch.Tensor         # e4m3 [E, 2I, H/16] or e8m0 [E, 2I, H/32]
    w2_scale: torch.Tensor          # e4m3 [E, H, I/16] or e8m0 [E, H, I/32]
    w13_scale_2: torch.Tensor       # float32 [E, 2] (gate, up)
    w2_scale_2: torch.Tensor        # float32 [E]
    w13_table: torch.Tensor         # float32 [E, 2, 4]
    w2_table: torch.Tensor          # float32 [E, 4]
    w13_delta: torch.Tensor         # uint8 [n, 2I, H/4]
    w2_delta: torch.Tensor          # uint8 [n, H, I/4]
    delta_experts: torch.Tensor     # int64 [n]
    layout: PlaneLayout = NATURAL   # how the planes and block scales are laid out (plane_layout.py)
    mid: MidPlanes | None = None    # the mid tier (None: the cache has none); its planes always natural

    @property
    def num_experts(self) -> int:
        return self.w13_base.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13_base.shape[2] * 4

    @property
    def inter(self) -> int:
        return self.w13_base.shape[1] // 2

    @property
    def e8m0(self) -> tuple[bool, bool]:
        """Whether w13's and w2's block scales are e8m0 (else e4m3)."""
        return (self.w13_scale.dtype == torch.float8_e8m0fnu, self.w2_scale.dtype == torch.float8_e8m0fnu)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "LayerPlanes":
        """Check names, shapes and dtypes; a layer loaded with delta="none" gets an empty tier."""
        # prepared by layout.prepare: the same planes and scales in another layout, under its names
        layout = PlaneLayout.of(t)
        name = layout.names
        base_names = (name["w13_base"], name["w2_base"])
        scale_names = (name["w13_weight_scale"], name["w2_weight_scale"])
        missing = [n for n in (*base_names, *scale_names,
                               "w13_weight_scale_2", "w2_weight_scale_2", "w13_table", "w2_table")
                   if n not in t]
        if missing:
            raise InputError(f"the layer's tensors lack {', '.join(missing)}",
                             "pass what Cache.load(..., expand=False) yields")
        b13, b2 = t[base_names[0]], t[base_names[1]]
        E, two_i, h4 = b13.shape
        H, I = h4 * 4, two_i // 2
        if b2.shape != (E, H, I // 4) or two_i % 2 or b13.dtype != torch.uint8 or b2.dtype != torch.uint8:
            raise InputError(f"w13_base {tuple(b13.shape)} and w2_base {tuple(b2.shape)} do not fit "
                             "[E, 2I, H/4] and [E, H, I/4] uint8")
        dev = b13.device
        if "delta_experts" in t:
            d13, d2, idx = t[name["w13_delta"]], t[name["w2_delta"]], t["delta_experts"]
        else:
            d13 = torch.empty((0, two_i, h4), dtype=torch.uint8, device=dev)
            d2 = torch.empty((0, H, I // 4), dtype=torch.uint8, device=dev)
            idx = torch.empty((0,), dtype=torch.int64, device=dev)
        n = idx.shape[0]
        if d13.shape != (n, two_i, h4) or d2.shape != (n, H, I // 4):
            raise InputError(f"tier planes {tuple(d13.shape)} / {tuple(d2.shape)} do not fit {n} "
                             "delta_experts")
        planes = cls(b13, b2, t[scale_names[0]], t[scale_names[1]],
                     t["w13_weight_scale_2"].float().reshape(E, 2), t["w2_weight_scale_2"].float().reshape(E),
                     t["w13_table"].float().reshape(E, 2, 4), t["w2_table"].float().reshape(E, 4),
                     d13, d2, idx.long(), layout, MidPlanes.from_tensors(t, H, I))
        for name, s, rows, cols in ((scale_names[0], planes.w13_scale, two_i, H),
                                    (scale_names[1], planes.w2_scale, H, I)):
            if s.dim() != 3 or s.shape[:2] != (E, rows) or s.shape[2] == 0 or cols % s.shape[2]:
                raise InputError(f"{name} {tuple(s.shape)} does not fit [E, {rows}, {cols}/group]")
            if s.dtype not in _SCALE_DTYPES:
                raise InputError(f"{name} must be float8_e4m3fn or float8_e8m0fnu, not {s.dtype}")
        return planes

    def natural(self) -> "LayerPlanes":
        """These planes in the natural layout (the Triton kernels read no other; dequant_expert puts back one
        expert at a time)."""
        if self.layout == NATURAL:
            return self
        return replace(self, w13_base=self.natural_of(self.w13_base), w2_base=self.natural_of(self.w2_base),
                       w13_delta=self.natural_of(self.w13_delta, delta=True),
                       w2_delta=self.natural_of(self.w2_delta, delta=True),
                       w13_scale=self.natural_of(self.w13_scale), w2_scale=self.natural_of(self.w2_scale),
                       layout=NATURAL)

    def natural_of(self, t: torch.Tensor, delta: bool = False, experts: list[int] | None = None) -> torch.Tensor:
        """One of these planes ([n, rows, K/4]; `delta`: a delta plane) or block-scale tensors in the natural
        layout: t itself, or a copy put back. `experts`: the experts of a base plane's rows (all, in order,
        when None), of which the tiled layout moved the tier experts' bits (plane_layout.py)."""
        if self.layout == NATURAL:
            return t
        rows = moved_rows(t, delta, list(range(t.shape[0])) if experts is None else experts,
                          set(self.delta_experts.tolist()), self.layout)

        return to_natural(t, rows, delta)

    def tier_rows(self) -> dict[int, int]:
        """expert -> its row in the tier planes."""
        return {int(e): k for k, e in enumerate(self.delta_experts.tolist())}

    @property
    def has_mid(self) -> bool:
        """Whether some expert of the layer is in the mid tier (a path that does not decode it must refuse)."""
        return self.mid is not None and self.mid.mid_experts.shape[0] > 0


def _index_codes(low_bits: int, device: torch.device) -> torch.Tensor:
    """int64 [256 << 4 * low_bits, 4]: the four codes an index `(base byte << 4 * low_bits) | low` decodes to,
    element j's `(base code << low_bits) | low code`: its base code from bits 2j..2j+1 of the base byte (the
    plane's packing), its low code from bits low_bits * j.. of `low` (four low codes: a delta byte's 2-bit
    ones, a mid nibble's bits, none)."""
    index = torch.arange(256 << 4 * low_bits, device=device).unsqueeze(1)
    j = torch.arange(4, device=device)
    base = (index >> (4 * low_bits + 2 * j)) & 3
    return (base << low_bits) | ((index >> (low_bits * j)) & ((1 << low_bits) - 1))


def _mid_nibbles(mid: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, K/8] mid plane -> uint8 [rows, K/4]: the four mid bits of base byte q's elements (4q..4q+3,
    bits 4(q % 2).. of mid byte q // 2)."""
    return torch.stack((mid & 15, mid >> 4), dim=-1).reshape(mid.shape[0], -1)


def _decode_(out: torch.Tensor, index: torch.Tensor, luts: torch.Tensor) -> torch.Tensor:
    """out float32 [rows, K] = the values of index int32 [rows, K/4] (a packed base byte and its low bits each)
    through luts [n, len, 4], the rows split evenly among the n tables (w13: gate rows, up rows): one lookup a
    byte, written in place (a fresh tensor per pass costs more than the pass)."""
    n = luts.shape[0]
    rows = index.shape[0] // n
    for k in range(n):
        torch.index_select(luts[k], 0, index[k * rows : (k + 1) * rows].reshape(-1),
                           out=out[k * rows : (k + 1) * rows].view(-1, 4))
    return out


def _scale_(w: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """w [rows, K] times its block scales [rows, K/group] then its per-row scale_2 [rows] (or one), in place:
    w * expand_block_scale(block_scale, K) * scale_2 bit for bit, each group's scale broadcast, not repeated."""
    w.view(w.shape[0], -1, _group(block_scale, w.shape[1])).mul_(block_scale.float().unsqueeze(-1))
    return w.mul_(scale_2.reshape(-1, 1))


def _values_(out: tuple[torch.Tensor, torch.Tensor], planes: LayerPlanes, expert: int, tier_row: int | None,
             mid_row: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """out's float32 code values (w13 [2I, H], w2 [H, I]) before scales: E2M1[(base << 2) | delta] (a tier row),
    mid_table[(base << 1) | mid] (a mid row), else table[base]; one lookup per packed base byte, by the byte and
    its low bits (its delta byte, its mid nibble), in 256-, 65536- or 4096-entry tables of 4 values."""
    b13, b2 = (_natural_row(planes, p, expert) for p in (planes.w13_base, planes.w2_base))
    i13, i2 = b13.int(), b2.int()
    dev = b13.device
    if tier_row is not None:
        d13, d2 = (_natural_row(planes, p, tier_row, True) for p in (planes.w13_delta, planes.w2_delta))
        i13.bitwise_left_shift_(8).bitwise_or_(d13)
        i2.bitwise_left_shift_(8).bitwise_or_(d2)
        lut = torch.tensor(E2M1, dtype=torch.float32, device=dev)[_index_codes(2, dev)].unsqueeze(0)
        lut13 = lut2 = lut
    elif mid_row is not None:
        m = planes.mid
        i13.bitwise_left_shift_(4).bitwise_or_(_mid_nibbles(m.w13_mid[mid_row]))
        i2.bitwise_left_shift_(4).bitwise_or_(_mid_nibbles(m.w2_mid[mid_row]))
        codes = _index_codes(1, dev)
        lut13 = m.w13_mid_table[mid_row][:, codes]  # [2, 4096, 4]: gate, up
        lut2 = m.w2_mid_table[mid_row][codes].unsqueeze(0)
    else:
        codes = _index_codes(0, dev)
        lut13 = planes.w13_table[expert][:, codes]  # [2, 256, 4]: gate, up
        lut2 = planes.w2_table[expert][codes].unsqueeze(0)
    return _decode_(out[0], i13, lut13), _decode_(out[1], i2, lut2)


def _natural_row(planes: LayerPlanes, t: torch.Tensor, i: int, delta: bool = False) -> torch.Tensor:
    """Row i (an expert, or a tier row of a `delta` plane) of one of planes' planes [n, rows, K/4] or block
    scales [n, rows, K/group] in the natural layout (put back, this row only, where the layer's is another)."""
    return planes.natural_of(t[i : i + 1], delta, [i])[0]


def dequant_expert(planes: LayerPlanes, expert: int, tier_row: int | None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13 [2I, H], w2 [H, I]) of one expert: its FP4 codes when tier_row is given, else its 3-bit
    codes through its 8-entry tables when it is in the layer's mid tier, else its base tables. `out`: two
    contiguous float32 tensors of those shapes on the planes' device to write them into (a loop over experts
    reuses them: a fresh tensor of this size costs its first touch of every page, more than the decode)."""
    H, I = planes.hidden, planes.inter
    dev = planes.w13_base.device
    if out is None:
        out = (torch.empty((2 * I, H), device=dev), torch.empty((H, I), device=dev))
    elif any(o.shape != shape or o.dtype != torch.float32 or o.device != dev or not o.is_contiguous()
             for o, shape in zip(out, ((2 * I, H), (H, I)))):
        raise InputError(f"dequant_expert writes into contiguous float32 [{2 * I}, {H}] and [{H}, {I}] on {dev}")
    mid_row = planes.mid.rows().get(expert) if planes.mid is not None and tier_row is None else None
    v13, v2 = _values_(out, planes, expert, tier_row, mid_row)
    s13, s2 = (_natural_row(planes, s, expert) for s in (planes.w13_scale, planes.w2_scale))
    return (_scale_(v13, s13, planes.w13_scale_2[expert].repeat_interleave(I)),
            _scale_(v2, s2, planes.w2_scale_2[expert]))
