import sys, time, torch
sys.path.insert(0, "examples/benchmark")
import moe_layer as ml
from moe_compile.kernels import ops
model, fn = ml.build("loop_moe", (256, 2048, 768, 128, 8))
x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
fn(x).sum().backward()  # compile (rehomes the weights)
ws_a = [e.w1.weight for e in model.experts]; ws_b = [e.w3.weight for e in model.experts]
xp = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
offs = (torch.arange(1, 129, device="cuda", dtype=torch.int32) * 16)
def run(f, reps=300):
    for _ in range(10): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / reps * 1e6
body = ops.grouped_mm_list_cat._init_fn
with torch.no_grad():
    a = run(lambda: torch.ops.moe_compile.grouped_mm_list_cat(xp, ws_a, ws_b, offs, True))
    b = run(lambda: body(xp, ws_a, ws_b, offs, True))
    c = run(lambda: torch.ops.moe_compile.grouped_mm_list(xp, ws_b, offs, [], True))
    d = run(lambda: ops.grouped_mm_list._init_fn(xp, ws_b, offs, [], True))
print(f"### dispatch: list_cat op {a:.0f} us vs body {b:.0f} us; list op {c:.0f} us vs body {d:.0f} us", flush=True)
import cProfile, pstats, io
from moe_compile.kernels import cuda
view = ops.pair_view(ws_a, ws_b, True)
def prof(label, f, reps=200):
    for _ in range(10): f()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(reps): f()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"### cProfile {label} x{reps}"); print(s.getvalue()[-6000:], flush=True)
with torch.no_grad():
    t_gmm = run(lambda: cuda.grouped_mm(xp, view, offs))
    from moe_compile.kernels import _triton_tma
    t_tma = run(lambda: _triton_tma.grouped_mm(xp, view, offs))
    print(f"### cuda.grouped_mm {t_gmm:.0f} us, _triton_tma.grouped_mm {t_tma:.0f} us", flush=True)
    prof("list_cat body", lambda: body(xp, ws_a, ws_b, offs, True))
