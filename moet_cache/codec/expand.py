"""Base (+ delta) planes back into packed FP4 codes, in memory, for a stock NVFP4 MoE kernel.

The compatibility path of the loader (`expand=True`): it saves load time, not memory, since the
result has the size of the FP4 codes. Works on CPU and CUDA tensors alike (plain bit operations),
and is tested against planes.join_planes, the exact numpy inverse of the split.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format.formats import e4m3_shift, e8m0_to_e4m3
from .planes import join_planes, nearest_code_for_table


def join_planes_torch(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """(base, delta) uint8 [..., n/4] -> packed FP4 uint8 [..., n/2] (same bits as planes.join_planes)."""
    if base.dtype != torch.uint8 or delta.dtype != torch.uint8 or base.shape != delta.shape:
        raise ValueError("base and delta planes must be uint8 tensors of one shape")
    # code_j = (base_j << 2) | delta_j for the four 2-bit fields j of each byte.
    c = [(((base >> (2 * j)) & 3) << 2) | ((delta >> (2 * j)) & 3) for j in range(4)]
    lo = c[0] | (c[1] << 4)
    hi = c[2] | (c[3] << 4)
    return torch.stack((lo, hi), dim=-1).reshape(*base.shape[:-1], base.shape[-1] * 2)


def nearest_delta_lut(table: np.ndarray) -> np.ndarray:
    """256-entry byte LUT: a base byte (four 2-bit codes) -> the delta byte that, joined with it,
    gives each code's FP4 code nearest its table value (planes.nearest_code_for_table)."""
    low = nearest_code_for_table(np.asarray(table, dtype=np.float32)) & 3  # delta bits per base code
    v = np.arange(256, dtype=np.uint32)
    out = np.zeros(256, dtype=np.uint32)
    for j in range(4):
        out |= low[(v >> (2 * j)) & 3].astype(np.uint32) << (2 * j)
    return out.astype(np.uint8)


def base_only_delta(base: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    """The delta plane that stands in for a base-only expert: nearest FP4 code to each table value."""
    lut = torch.from_numpy(nearest_delta_lut(table)).to(base.device)
    return lut[base.long()]


def expand_projection(base: torch.Tensor, tables: np.ndarray, delta_rows: dict[int, torch.Tensor],
                      rows_per_table: int) -> torch.Tensor:
    """Packed FP4 codes [E, rows, n/2] of one fused projection (w13 or w2).

    base: uint8 [E, rows, n/4]; tables: float32 [E, k, 4] with k = rows / rows_per_table
    (w13: gate rows then up rows, each with its own table; w2: one table); delta_rows: the
    delta plane [rows, n/4] of each expert that has one. Experts without one get the nearest code.
    """
    E, rows = base.shape[0], base.shape[1]
    out = torch.empty((E, rows, base.shape[2] * 2), dtype=torch.uint8, device=base.device)
    on_cpu = base.device.type == "cpu"
    for e in range(E):
        d = delta_rows.get(e)
        if on_cpu:
            # numpy's 64K-entry LUT join is ~4x faster than torch bit ops on a CPU.
            b = base[e].numpy()
            if d is None:
                dn = np.concatenate([np.take(nearest_delta_lut(tables[e, k]), b[k * rows_per_table:(k + 1) * rows_per_table])
                                     for k in range(rows // rows_per_table)], axis=0)
            else:
                dn = d.numpy()
            out[e] = torch.from_numpy(join_planes(b, dn))
            continue
        if d is None:
            parts = [base_only_delta(base[e, k * rows_per_table:(k + 1) * rows_per_table], tables[e, k])
                     for k in range(rows // rows_per_table)]
            d = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        out[e] = join_planes_torch(base[e], d)
    return out


def expand_scales(scale: torch.Tensor, scale_2: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact block scales (float8_e8m0fnu [E, rows, n/32]) as stock NVFP4 ones: float8_e4m3fn
    [E, rows, n/16] and scale_2 ([E, parts], or [E] when parts is 1) with the same products.

    Each (expert, part) keeps its scale_2 when its scales fit e4m3's powers of two (2^-9 .. 2^8: the
    MXFP4->NVFP4 cast's, which come back as the source's exact e4m3 bytes); otherwise a power of two
    moves from the block scales into scale_2 (MXFP4 sources, whose scale_2 is 1.0).
    """
    dev = scale.device
    raw = scale.view(torch.uint8).cpu().numpy()
    s2 = scale_2.to(torch.float32).cpu().numpy().reshape(raw.shape[0], parts).copy()
    E, rows = raw.shape[0], raw.shape[1]
    per = rows // parts
    out = np.empty((E, rows, raw.shape[2] * 2), dtype=np.uint8)
    for e in range(E):
        for k in range(parts):
            block = raw[e, k * per:(k + 1) * per]
            shift = e4m3_shift(block)
            out[e, k * per:(k + 1) * per] = e8m0_to_e4m3(block, shift)
            s2[e, k] = np.float32(np.ldexp(np.float64(s2[e, k]), shift))
    s2_t = torch.from_numpy(s2 if parts > 1 else s2.reshape(E)).to(dev)
    return torch.from_numpy(out).view(torch.float8_e4m3fn).to(dev), s2_t


__all__ = ["join_planes_torch", "nearest_delta_lut", "base_only_delta", "expand_projection", "expand_scales"]
