"""The plane kernels' tiles: every layer the plane kernels take is stored, from load on, with each 16-row
tile of every plane and block-scale tensor reordered chunk-major (`tile`). A row's K splits into chunks
of 256 codes (nvrtc.CHUNK_WORDS words, the unit a decode warp reads), and a tile is stored as
[chunk][16 rows][the row's bytes of that chunk] (64 plane bytes; 8 e8m0 or 16 e4m3 scale bytes), so that
a warp's load of one chunk of its 16 rows is one contiguous run of memory where row-major rows put it at
16 places (mma_bits.cu tiled_at; the decode 7-22% faster at T = 1-64 for x4 layers, and
docs/RUNTIME.md for fitted-table ones).

A layer built with `--base-table x4` also has every plane's bits moved for the x4 decode (x4_table.py): the
x4 layout (plane_layout.X4). Any other layer the kernels take (fitted tables) is tiled, with the bits of
its tier experts' base rows and of its delta planes moved as an x4 layer's, so that its tier experts take
the x4 tier decode (mma_bits.cu x4_tier_reg: 3-5 integer ops a register where the natural bits' tier_regs
takes about ten; the loop of two chunks 1505 against 668 SASS instructions) while its base experts keep
the natural bits and the table lookup: the tiled layout (plane_layout.TILED). plane_layout.py names the
layouts and moves a tensor into one; layout.py picks a layer's at load.
"""

from __future__ import annotations

import torch

from ..format.formats import FORM_DTYPE, FORM_GROUP
from ..stheader import torch_dtype
from .nvrtc import CHUNK_WORDS

#: the rows of a tile, reordered chunk-major together (the 16 rows of one decode warp: mma's M)
TILE_ROWS = 16
#: the K codes of a chunk (words of 16 codes)
CHUNK_CODES = 16 * CHUNK_WORDS

#: experts reordered per torch call: bounds the temporaries (a V4-Flash w13 expert is 4 MiB of planes)
EXPERTS_A_STEP = 16


def _chunk_bytes(t: torch.Tensor) -> int:
    """A row's bytes in one chunk: a plane's (2 bits a code) or a block-scale tensor's (a byte per group of
    its scale form: formats.FORM_GROUP)."""
    if t.dtype == torch.uint8:
        return CHUNK_CODES // 4
    group = {torch_dtype(FORM_DTYPE[form]): FORM_GROUP[form] for form in FORM_GROUP}[t.dtype]
    return CHUNK_CODES // group


def tile(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """A plane or block-scale tensor [n, rows, row bytes] with each tile of TILE_ROWS rows reordered
    chunk-major ([chunk][row][the row's chunk bytes]), or (`inverse`) back to row-major; a copy, same
    shape and dtype. Rows must split into whole tiles and each row into whole chunks."""
    n, rows, width = t.shape
    c = _chunk_bytes(t)
    if rows % TILE_ROWS or width % c:
        raise ValueError(f"[{n}, {rows}, {width}] does not split into {TILE_ROWS}-row tiles of {c}-byte chunks")
    tiles, chunks = rows // TILE_ROWS, width // c
    split = (n, tiles, chunks, TILE_ROWS, c) if inverse else (n, tiles, TILE_ROWS, chunks, c)
    u8 = t.contiguous().view(torch.uint8).view(split)
    # a copy always (`contiguous` would hand back t itself where a row is one chunk)
    return u8.transpose(2, 3).clone(memory_format=torch.contiguous_format).view(t.dtype).view(n, rows, width)


def tile_(t: torch.Tensor, inverse: bool = False) -> None:
    """`tile` in place, a few experts' temporaries at a time."""
    for i in range(0, t.shape[0], EXPERTS_A_STEP):
        t[i : i + EXPERTS_A_STEP] = tile(t[i : i + EXPERTS_A_STEP], inverse)


def tiles_fit(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the layer's planes split into tiles: rows in whole tiles, K in whole chunks (always so where
    the plane kernels take the layer: layout.kernels_take)."""
    return all(t.shape[1] % TILE_ROWS == 0 and (t.shape[2] * 4) % CHUNK_CODES == 0
               for t in (tensors["w13_base"], tensors["w2_base"]))

