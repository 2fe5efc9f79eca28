"""The routed experts' weights in every form the quality ladder compares, from the FP4 codes.

A layer's experts are held as their FP4 codes (0..15, E2M1) and the real-valued scale of each weight
(block scale x global scale), read from a lossless cache's planes: code = (base << 2) | delta. Each form
maps the codes to values:
  fp4        E2M1[code]                                    4 bits a weight (+ block scales)
  base       table[code >> 2], the cache's own table (x4 or fitted)  2 bits
  3bit       table3[code >> 1]: the base plus the delta's high bit, an 8-entry table fitted as the cache
             fits its 4-entry one (the mean E2M1 value of each code's bucket, per expert and projection)  3 bits
  1bit       sign(code) * m: the base's high bit (the sign), m = mean |E2M1| per expert and projection  1 bit
  lloyd      not nested: each block of `block` weights along the input gets its own 4-level codebook
             fitted by Lloyd iterations to the FP4 weights, entries stored in FP8 e4m3 with a per-tensor
             scale; 2 bits + 32 / block bits a weight, no FP4 block scales
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet_cache.runtime.dequant import E2M1, LayerPlanes, expand_block_scale, unpack_plane

E2M1_T = torch.tensor(E2M1, dtype=torch.float32)
FP8_MAX = 448.0


@dataclass(frozen=True)
class Proj:
    """One stacked projection of a layer: w13 [E, 2I, H] (gate rows then up rows) or w2 [E, H, I]."""

    codes: torch.Tensor      # uint8 [E, rows, cols], 0..15
    scale: torch.Tensor      # float32 [E, rows, cols]: block scale x global scale of each weight
    table: torch.Tensor      # float32 [E, rows, 4]: the cache's base table of each row
    groups: int              # tables per expert: 2 for w13 (gate, up), 1 for w2
    scale_bytes: int         # bytes of the block scales as the cache stores them, all experts

    @property
    def experts(self) -> int:
        return self.codes.shape[0]

    def fp4(self) -> torch.Tensor:
        return E2M1_T[self.codes.long()] * self.scale

    def base(self) -> torch.Tensor:
        return torch.gather(self.table, 2, (self.codes >> 2).long()) * self.scale

    def _group_rows(self) -> torch.Tensor:
        """[E, groups, rows/groups, cols] view index helper: codes split by table group."""
        E, rows, cols = self.codes.shape
        return self.codes.reshape(E, self.groups, rows // self.groups, cols)

    def three_bit(self) -> torch.Tensor:
        E, rows, cols = self.codes.shape
        c = self._group_rows().long().reshape(E, self.groups, -1)
        hist = torch.zeros(E, self.groups, 16).scatter_add_(2, c, torch.ones_like(c, dtype=torch.float32))
        h8 = hist.reshape(E, self.groups, 8, 2)
        pair_values = E2M1_T.reshape(8, 2)
        n = h8.sum(-1)
        table3 = torch.where(n > 0, (h8 * pair_values).sum(-1) / n.clamp_min(1), pair_values.mean(-1))
        vals = torch.gather(table3, 2, c >> 1).reshape(E, rows, cols)
        return vals * self.scale

    def one_bit(self) -> torch.Tensor:
        E, rows, cols = self.codes.shape
        c = self._group_rows().long().reshape(E, self.groups, -1)
        m = E2M1_T[c].abs().mean(-1, keepdim=True)
        sign = torch.where((c & 8) > 0, -1.0, 1.0)
        return (sign * m).reshape(E, rows, cols) * self.scale

    def lloyd(self, block: int, iters: int = 10) -> torch.Tensor:
        """Per-block 4-level codebooks (Lloyd iterations from the block's quartile midpoints)."""
        w = self.fp4()
        E, rows, cols = w.shape
        x = w.reshape(-1, block)
        qs = torch.quantile(x, torch.tensor([0.125, 0.375, 0.625, 0.875]), dim=1).T.contiguous()  # [N, 4]
        levels = qs

        def nearest(levels: torch.Tensor) -> torch.Tensor:
            # the levels stay sorted (each is the mean of the values between its neighbours' midpoints)
            mids = (levels[:, 1:] + levels[:, :-1]) / 2
            return (x.unsqueeze(-1) > mids.unsqueeze(1)).sum(-1)
        for _ in range(iters):
            idx = nearest(levels)
            sums = torch.zeros_like(levels).scatter_add_(1, idx, x)
            counts = torch.zeros_like(levels).scatter_add_(1, idx, torch.ones_like(x))
            levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
        # entries stored as FP8 e4m3 times one float32 scale per expert projection
        s = (levels.reshape(E, -1).abs().amax(-1) / FP8_MAX).clamp_min(1e-30)
        stored = (levels.reshape(E, -1) / s[:, None]).to(torch.float8_e4m3fn).float() * s[:, None]
        levels = stored.reshape(-1, 4)
        idx = nearest(levels)
        return torch.gather(levels, 1, idx).reshape(E, rows, cols)


def proj_from_planes(base: torch.Tensor, delta: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor,
                     table: torch.Tensor, groups: int) -> Proj:
    """A projection from a lossless cache's planes loaded with delta="all" (natural layout)."""
    codes = (unpack_plane(base) << 2) | unpack_plane(delta)
    E, rows, cols = codes.shape
    per_row_s2 = scale_2.reshape(E, groups).repeat_interleave(rows // groups, dim=1).unsqueeze(-1)
    scale = expand_block_scale(block_scale, cols) * per_row_s2
    row_table = table.reshape(E, groups, 4).repeat_interleave(rows // groups, dim=1)
    return Proj(codes, scale, row_table, groups, block_scale.numel() * block_scale.element_size())


@dataclass(frozen=True)
class LayerCodes:
    layer: int
    w13: Proj
    w2: Proj

    @classmethod
    def from_tensors(cls, layer: int, tensors: dict[str, torch.Tensor]) -> "LayerCodes":
        p = LayerPlanes.from_tensors(tensors).natural()
        if p.delta_experts.tolist() != list(range(p.num_experts)):
            raise ValueError("load the lossless cache with delta='all'")
        return cls(layer, proj_from_planes(p.w13_base, p.w13_delta, p.w13_scale, p.w13_scale_2, p.w13_table, 2),
                   proj_from_planes(p.w2_base, p.w2_delta, p.w2_scale, p.w2_scale_2, p.w2_table, 1))


def form_weights(lc: LayerCodes, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    def of(p: Proj) -> torch.Tensor:
        return {"fp4": p.fp4, "base": p.base, "3bit": p.three_bit, "1bit": p.one_bit}[form]()
    return of(lc.w13), of(lc.w2)


def mixed_weights(lc: LayerCodes, forms: list[str], cache: dict[str, tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """w13, w2 with expert e in forms[e] (cache: form -> that form's weights for every expert)."""
    w13 = torch.stack([cache[f][0][e] for e, f in enumerate(forms)])
    w2 = torch.stack([cache[f][1][e] for e, f in enumerate(forms)])
    return w13, w2


def sq_errors(lc: LayerCodes, cache: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """form -> [E] squared weight error against FP4 over w13 and w2 (real units)."""
    ref13, ref2 = cache["fp4"]
    return {f: ((w13 - ref13) ** 2).sum((1, 2)) + ((w2 - ref2) ** 2).sum((1, 2)) for f, (w13, w2) in cache.items()}
