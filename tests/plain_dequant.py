"""One expert's weights dequantized the plain way: every 2-bit code unpacked into its own byte, looked up one
by one through int64 indices, each block scale repeated over its group, then multiplied; and the MoE layer on
them, each expert's weights fresh tensors. The definitions moet_cache.runtime's dequant_expert and
fused_moe_reference must give bit for bit (tests/test_runtime_dequant.py), and the baseline
benchmarks/bench_dequant.py measures them against."""

from __future__ import annotations

import torch

from moet_cache.runtime.activation import swiglu
from moet_cache.runtime.dequant import E2M1, LayerPlanes


def unpack_plane(plane: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/4] plane -> uint8 [..., n] 2-bit codes (element 4k+j from bits 2j..2j+1)."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=plane.device)
    codes = (plane.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(plane.shape[:-1] + (plane.shape[-1] * 4,))


def unpack_mid(plane: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/8] mid plane -> uint8 [..., n] bits (element 8k+j from bit j of byte k)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=plane.device)
    bits = (plane.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(plane.shape[:-1] + (plane.shape[-1] * 8,))


def expand_block_scale(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """Block scales [..., in/group] -> float32 [..., in], each repeated over its group."""
    return scale.float().repeat_interleave(in_features // scale.shape[-1], dim=-1)


def _values(base: torch.Tensor, delta: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
    """Code values before scales: E2M1[(base << 2) | delta], or table[base] with one [4] table a row."""
    codes = unpack_plane(base).long()
    if delta is not None:
        e2m1 = torch.tensor(E2M1, dtype=torch.float32, device=base.device)
        return e2m1[(codes << 2) | unpack_plane(delta).long()]
    return torch.gather(table, 1, codes)


def _mid_values(base: torch.Tensor, mid: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Code values before scales of a mid-tier expert: table[(base << 1) | mid], one [8] table a row."""
    codes = (unpack_plane(base).long() << 1) | unpack_mid(mid).long()
    return torch.gather(table, 1, codes)


def _natural_row(planes: LayerPlanes, t: torch.Tensor, i: int, delta: bool = False) -> torch.Tensor:
    return planes.natural_of(t[i : i + 1], delta, [i])[0]


def plain_dequant_expert(planes: LayerPlanes, expert: int,
                         tier_row: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13 [2I, H], w2 [H, I]) of one expert: its FP4 codes when tier_row is given, else its 3-bit
    codes through its 8-entry tables when it is in the layer's mid tier, else its base tables."""
    I, H = planes.inter, planes.hidden
    b13, b2 = (_natural_row(planes, p, expert) for p in (planes.w13_base, planes.w2_base))
    mid_row = planes.mid.rows().get(expert) if planes.mid is not None and tier_row is None else None
    if mid_row is not None:
        m = planes.mid
        v13 = _mid_values(b13, m.w13_mid[mid_row], m.w13_mid_table[mid_row].repeat_interleave(I, dim=0))
        v2 = _mid_values(b2, m.w2_mid[mid_row], m.w2_mid_table[mid_row].expand(H, 8))
    else:
        d13 = d2 = None
        if tier_row is not None:
            d13, d2 = (_natural_row(planes, p, tier_row, True) for p in (planes.w13_delta, planes.w2_delta))
        row_table = planes.w13_table[expert].repeat_interleave(I, dim=0)  # [2I, 4]: gate rows, then up rows
        v13 = _values(b13, d13, row_table)
        v2 = _values(b2, d2, planes.w2_table[expert].expand(H, 4))
    s2_13 = planes.w13_scale_2[expert].repeat_interleave(I).unsqueeze(1)  # [2I, 1]
    s13, s2 = (_natural_row(planes, s, expert) for s in (planes.w13_scale, planes.w2_scale))
    w13 = v13 * expand_block_scale(s13, H) * s2_13
    w2 = v2 * expand_block_scale(s2, I) * planes.w2_scale_2[expert]
    return w13, w2


def plain_fused_moe_reference(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """float32 [T, H]: sum_k topk_weights[t, k] * down_e(act(gate_e x_t, up_e x_t)), the weights and the SwiGLU
    output rounded to x's dtype, products summed in float32; expert -1 counts nothing."""
    T, H, I = x.shape[0], planes.hidden, planes.inter
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if T == 0 or topk_ids.numel() == 0:
        return out
    xf = x.float()
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    rows = planes.tier_rows()
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue
        pick = (flat_ids == e).nonzero().squeeze(1)
        w13, w2 = (w.to(x.dtype).float() for w in plain_dequant_expert(planes, e, rows.get(e)))
        t = tokens[pick]
        gate_up = xf[t] @ w13.T
        act = swiglu(gate_up[:, :I], gate_up[:, I:], swiglu_limit).to(x.dtype).float()
        out.index_add_(0, t, (act @ w2.T) * flat_w[pick].unsqueeze(1))
    return out
