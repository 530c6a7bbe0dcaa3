"""Per-kernel GPU time of one decode token's dispatches (Phi-3-mini shapes, random weights): N repeats in one pass."""
import time, numpy as np, sys
sys.path.insert(0, ".")
from engine.gpu import Gpu, Recorder
from engine.bench import shape_spec, random_weights
from engine.transformer import DenseTransformer
from engine.matmul import matvec_plan
g = Gpu(); spec = shape_spec("phi3-mini")
rt = DenseTransformer(g, spec, random_weights(spec), max_context=1024, prefill_chunk=64)
rt.reset(); rt.prefill(np.arange(600, dtype=np.uint32) % 1000); rt.read_sampled(0)
rt._write_step(1, 600, 1, 10)
b = rt.layer_bg[0]; p = rt.p; s = spec
items = {
 "qkv_fused": (p["qkv_fused"], b["qkv_fused"], rt.qkv_fused_grid),
 "attn600": (p["attn"], b["attn"], (s.n_heads, 1, 1)),
 "attn600_split10": (p["attn_split"], b["attn_split"], (s.n_heads, 1, 10)),
 "combine": (p["combine"], rt.bg["combine"], (s.n_heads, 1)),
 "mv_qkv": (p["mv_qkv"], b["mv_qkv"], matvec_plan(*rt.mats["qkv"][:2])[1]),
 "rope_append": (p["rope_append"], b["rope_append"], (1, 8)),
 "mv_o": (p["mv_o"], b["mv_o"], matvec_plan(*rt.mats["o"][:2])[1]),
 "mv_gate_up": (p["mv_gate_up"], b["mv_gate_up"], matvec_plan(s.dim, s.ffn_dim, gate_up=True)[1]),
 "mv_down": (p["mv_down"], b["mv_down"], matvec_plan(*rt.mats["down"][:2])[1]),
 "add_norm": (p["add_norm"], b["add_norm1"], (1,)),
 "lm_head": (p["mv_lm"], rt.bg["mv_lm"], matvec_plan(s.dim, s.vocab, last_row=True)[1]),
 "argmax": (p["argmax"], rt.bg["argmax"], (1,)),
 "embed": (p["embed"], rt.bg["embed"], (-(-s.dim // 8 // 64), 1)),
}
N = 200
for name, (pipe, bg, grid) in items.items():
    ts = []
    for rep in range(3):
        rec = Recorder(g, "prof")
        for _ in range(N): rec.dispatch(pipe, bg, *grid)
        g.sync(); t = time.perf_counter(); rec.submit(); g.sync(); ts.append(time.perf_counter() - t)
    print(f"{name:12s} {min(ts)/N*1e6:8.1f} us/dispatch  grid={grid}")
# submit overhead: empty token-sized submits
ts=[]
for _ in range(50):
    t=time.perf_counter(); rec = Recorder(g,"e"); rt._record_body(rec,1,1); rec.submit(); g.sync(); ts.append(time.perf_counter()-t)
print("one full decode body submit+sync ms", np.median(ts)*1e3)
# host cost of recording + submitting one token (no wait), and GPU time of 20 queued tokens
ts = []
g.sync()
t0 = time.perf_counter()
for _ in range(20):
    t = time.perf_counter(); rec = Recorder(g, "e"); rt._record_body(rec, 1, 1); rec.submit(); ts.append(time.perf_counter() - t)
t1 = time.perf_counter(); g.sync(); t2 = time.perf_counter()
print(f"host record+submit per token ms {np.median(ts)*1e3:.2f}; 20 tokens wall {(t2-t0)*1e3:.1f} ms, wait after last submit {(t2-t1)*1e3:.1f} ms")
