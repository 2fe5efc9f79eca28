"""Pairs (token, slot) sorted by expert into blocks of BM, with torch ops only and no host sync
(so a CUDA graph can hold it): the grid is sized by an upper bound and padding blocks say -1."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Blocks:
    sorted_pairs: torch.Tensor  # int32 [max_blocks * BM]: pair index t * top_k + slot, -1 = padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert of each block, -1 = unused block
    max_blocks: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Blocks:
    """Group the pairs of `topk_ids` [T, top_k] by expert, each expert's run padded to a multiple of bm."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    dev = flat.device
    max_blocks = P // bm + min(num_experts, P)  # sum_e ceil(c_e / bm) <= P // bm + (experts hit)
    # not torch.bincount: on CUDA it reads the max back to the host, which a graph capture refuses
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).index_add_(0, flat, torch.ones_like(flat))
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts
    slot = (blk_end - nblk)[sorted_e] * bm + torch.arange(P, device=dev) - first[sorted_e]
    sorted_pairs = torch.full((max_blocks * bm,), -1, dtype=torch.int32, device=dev)
    sorted_pairs[slot] = order.to(torch.int32)
    b = torch.arange(max_blocks, device=dev)
    block_expert = torch.searchsorted(blk_end, b, right=True)
    block_expert = torch.where(b < blk_end[-1], block_expert, -1).to(torch.int32)
    return Blocks(sorted_pairs, block_expert, max_blocks)
