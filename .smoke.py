import sys, time, torch
sys.path.insert(0, ".devwork"); sys.path.insert(0, ".devwork/benchmarks")
from bench_moe import timed
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.launch import Config, Mma, fused_moe_cuda
from moet_cache.runtime.reference import fused_moe_reference
E, K, H, I = 256, 6, 4096, 2048
cfgs = {1: [Mma(1, 4, 4, True), Mma(1, 4, 4, True, False), Mma(1, 2, 2, True), Mma(1, 8, 8, True), Mma(1, 4, 8, True)],
        4: [Mma(1, 4, 4, True), Mma(1, 2, 2, True), Mma(1, 4, 4)],
        16: [Mma(1, 4, 4, True), Mma(1, 4, 4, True, False), Mma(1, 2, 2, True), Mma(1, 4, 4), Mma(2, 2, 2)],
        64: [Mma(2, 2, 2), Mma(4, 1, 1), Mma(4, 2, 2)],
        4096: [Mma(4, 1, 1), Mma(8, 1, 1)]}
for e8 in (True, False):
    t = random_layer(E, H, I, n_tier=26, e8m0=e8, device="cuda", seed=1)
    none = {k: v for k, v in t.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    for T, blks in cfgs.items():
        if not e8 and T not in (1, 16): continue
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand((T, E), generator=g, device="cuda").topk(K, dim=1).indices
        w = torch.rand((T, K), generator=g, device="cuda")
        ids_t = ids.clone(); ids_t[0, :2] = t["delta_experts"][:2]
        Pn, Pt = LayerPlanes.from_tensors(none), LayerPlanes.from_tensors(t)
        ref = fused_moe_reference(x, Pt, w, ids_t, 7.0)
        base_us, _ = timed(lambda: fused_moe_cuda(x, Pn, w, ids, 7.0, Config(mma=False)))
        line = [f"e8={e8} T={T} triton {base_us:.1f}"]
        for blk in blks:
            try:
                got = fused_moe_cuda(x, Pt, w, ids_t, 7.0, Config.only(blk)); torch.cuda.synchronize()
                rel = ((got.float() - ref).norm() / ref.norm()).item()
                us, note = timed(lambda: fused_moe_cuda(x, Pn, w, ids, 7.0, Config.only(blk)))
                line.append(f"{blk.nt},{blk.ks13},{blk.ks2},{'D' if blk.direct else 'S'}{'' if blk.prefetch else '-nopf'}: {us:.1f} (rel {rel:.1e})")
            except Exception as ex:
                line.append(f"{blk} FAIL {type(ex).__name__} {str(ex)[:1500]}")
        print(" | ".join(line), flush=True)
