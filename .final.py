import sys, time, torch
sys.path.insert(0, ".devwork"); sys.path.insert(0, ".devwork/benchmarks")
import bench_moe as B
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.launch import Config, fused_moe_cuda, DEFAULT
from moet_cache.runtime.reference import fused_moe_reference
E, K, H, I = 256, 6, 4096, 2048
t0 = time.time()
t = random_layer(E, H, I, n_tier=26, e8m0=True, device="cuda", seed=1)
none = {k: v for k, v in t.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
Pt, Pn = LayerPlanes.from_tensors(t), LayerPlanes.from_tensors(none)
for T in (1, 7, 16, 64):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand((T, E), generator=g, device="cuda").topk(K, dim=1).indices
    ids[0, :3] = t["delta_experts"][:3]
    w = torch.rand((T, K), generator=g, device="cuda")
    got = fused_moe_cuda(x, Pt, w, ids, 7.0)
    ref = fused_moe_reference(x, Pt, w, ids, 7.0)
    print(f"check T={T} {DEFAULT.pick(T * K)} rel={((got.float() - ref).norm() / ref.norm()).item():.2e}", flush=True)
copy = B.copy_bandwidth()
print(f"copy {copy:.0f} GB/s  ({time.time() - t0:.0f} s)", flush=True)
gg = torch.Generator(device="cuda").manual_seed(3)
w13 = (torch.randn((E, 2 * I, H), generator=gg, device="cuda") * 0.02).to(torch.bfloat16)
w2 = (torch.randn((E, H, I), generator=gg, device="cuda") * 0.02).to(torch.bfloat16)
hum = B.Humming(w13, w2, B.MXFP4)
del w13, w2
print(f"humming ready ({time.time() - t0:.0f} s)", flush=True)
for T in (1, 4, 16, 64):
    w, ids = B.routing(T, 10 + T)
    x = (torch.randn((T, H), device="cuda") * 0.5).to(torch.bfloat16)
    hit = len(set(ids.reshape(-1).tolist()))
    ours, _ = B.timed(lambda: fused_moe_cuda(x, Pn, w, ids, 10.0))
    ourt, _ = B.timed(lambda: fused_moe_cuda(x, Pt, w, ids, 10.0))
    tri, _ = B.timed(lambda: fused_moe_cuda(x, Pn, w, ids, 10.0, Config(mma=False)))
    run = hum.prepare(ids)
    hu, _ = B.timed(lambda: run(x, w))
    nb = hit * B.plane_bytes_per_expert(none)
    print(f"T={T} experts={hit} ours {ours:.1f} us ({nb / ours / 1e3:.0f} GB/s, {100 * nb / ours / 1e3 / copy:.1f}% copy) "
          f"tier10% {ourt:.1f}  triton {tri:.1f}  humming-mxfp4 {hu:.1f}  => x{hu / ours:.2f} vs humming", flush=True)
