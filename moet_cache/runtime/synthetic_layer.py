"""A random layer in the plane format at any size, built on any device (GPU tests and benchmarks).

Random planes, tables and scales: right for speed and for kernel-against-reference checks, not for
fidelity (that uses a real cache of quantized t(5) weights; benchmarks/bench_moe.py --fidelity).
"""

from __future__ import annotations

import torch


def random_layer(E: int, H: int, I: int, n_tier: int, e8m0: bool, device: str | torch.device,
                 seed: int = 0, n_mid: int = 0) -> dict[str, torch.Tensor]:
    """Tensors named as Cache.load(..., expand=False) names them; `n_tier` random tier experts and, with
    `n_mid`, that many random mid-tier experts among the others (the same tensors as before otherwise)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def plane(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=device)

    def scales(rows: int, cols: int) -> torch.Tensor:
        if e8m0:  # powers of two near 1 (2^-4 .. 2^3)
            b = torch.randint(123, 131, (E, rows, cols // 32), generator=g, dtype=torch.uint8, device=device)
            return b.view(torch.float8_e8m0fnu)
        s = torch.rand((E, rows, cols // 16), generator=g, device=device) * 3 + 0.05
        return s.to(torch.float8_e4m3fn)

    t = {"w13_base": plane(E, 2 * I, H // 4), "w2_base": plane(E, H, I // 4),
         "w13_weight_scale": scales(2 * I, H), "w2_weight_scale": scales(H, I),
         "w13_weight_scale_2": torch.rand((E, 2), generator=g, device=device) * 0.02 + 0.01,
         "w2_weight_scale_2": torch.rand((E,), generator=g, device=device) * 0.02 + 0.01}
    base_tab = torch.tensor([0.8, 3.3, -0.8, -3.3], device=device)
    t["w13_table"] = base_tab + 0.2 * torch.randn((E, 2, 4), generator=g, device=device)
    t["w2_table"] = base_tab + 0.2 * torch.randn((E, 4), generator=g, device=device)
    tier = torch.randperm(E, generator=g, device=device)[:n_tier].sort().values
    t["delta_experts"] = tier.long()
    t["w13_delta"] = plane(n_tier, 2 * I, H // 4)
    t["w2_delta"] = plane(n_tier, H, I // 4)
    if n_mid:
        rest = torch.tensor([e for e in range(E) if e not in set(tier.tolist())], device=device)
        mid = rest[torch.randperm(rest.numel(), generator=g, device=device)[:n_mid]].sort().values
        mid_tab = torch.tensor([0.3, 1.2, 2.5, 5.0, -0.3, -1.2, -2.5, -5.0], device=device)
        t["mid_experts"] = mid.long()
        t["w13_mid"], t["w2_mid"] = plane(n_mid, 2 * I, H // 8), plane(n_mid, H, I // 8)
        t["w13_mid_table"] = mid_tab + 0.1 * torch.randn((n_mid, 2, 8), generator=g, device=device)
        t["w2_mid_table"] = mid_tab + 0.1 * torch.randn((n_mid, 8), generator=g, device=device)
    return t
