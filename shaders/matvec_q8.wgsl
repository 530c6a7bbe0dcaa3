// Decode matvec on 4-bit weights with int8 activations (quantize_q8.wgsl): the dot products run four
// products per dot4I8Packed instead of dequantising every weight to f32, which bench/matvec_probe.py measured
// as the matvecs' bottleneck on the H200 (the same loads without the dequant ALU ran ~2× faster, dp4a ~3×).
// Activations carry int8 rounding per 32-element chunk (relative error ~0.4% of the chunk's largest value), as
// llama.cpp's q8_1 activations do; prefill GEMMs keep f32.
// Each subgroup owns ROWS outputs (as matvec_sg.wgsl, whose BLOCKS rule this shares) and its lanes walk K one
// 32-element chunk (one vec4<u32> of weights) at a time. Per chunk: Σ (q − ZERO)·x = xs·(Σ q·xq − ZERO·Σ xq),
// or with AFFINE Σ (s·q + m)·x = xs·(s·Σ q·xq + m·Σ xq).
// Constants: K, N, WG, ROWS, BLOCKS, GATE_UP (y = silu(gate)·up, gate rows then up rows), ZERO, AFFINE, GROUP.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (write), 4 xm vec2<f32>[K / 32]. Grid: fold_grid(ceil(N / (ROWS · BLOCKS))).
#import reduce

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

const CHUNKS: u32 = K / 32u;
const GROUPS: u32 = K / GROUP;
const CPG: u32 = GROUP / 32u;                // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);     // f16 per group: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);
const WROWS: u32 = ROWS * MATS;
const NIB: u32 = 0x0F0F0F0Fu;

// Σ q·xq over one chunk: word j's even nibbles meet u32 2j of the chunk's activation bytes, odd ones u32 2j + 1.
fn dot32(v: vec4<u32>, a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(v.x & NIB, a.x) + dot4I8Packed((v.x >> 4u) & NIB, a.y)
         + dot4I8Packed(v.y & NIB, a.z) + dot4I8Packed((v.y >> 4u) & NIB, a.w)
         + dot4I8Packed(v.z & NIB, b.x) + dot4I8Packed((v.z >> 4u) & NIB, b.y)
         + dot4I8Packed(v.w & NIB, b.z) + dot4I8Packed((v.w >> 4u) & NIB, b.w);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        let first = (group_id * BLOCKS + blk) * ROWS;
        var row: array<u32, WROWS>;  // rows past N are clamped to N - 1: read, summed, never written
        for (var i = 0u; i < WROWS; i++) { row[i] = (i / ROWS) * N + min(first + i % ROWS, N - 1u); }
        var acc = array<f32, WROWS>();  // the initializer runs per block (naga hoists declarations)
        for (var c = lane.sg_lane; c < CHUNKS; c += lane.sg_size) {
            var words: array<vec4<u32>, WROWS>;
            var scales: array<f32, WROWS>;
            var mins: array<f32, WROWS>;
            for (var i = 0u; i < WROWS; i++) {
                words[i] = w[row[i] * CHUNKS + c];
                let si = (row[i] * GROUPS + c / CPG) * SPG;
                scales[i] = f32(s[si]);
                if (AFFINE) { mins[i] = f32(s[si + 1u]); }
            }
            let a = xq[2u * c];
            let b = xq[2u * c + 1u];
            let m = xm[c];  // (activation scale, Σ xq)
            let qsum = i32(m.y);
            for (var i = 0u; i < WROWS; i++) {
                let d = dot32(words[i], a, b);
                if (AFFINE) {
                    acc[i] += m.x * (scales[i] * f32(d) + mins[i] * m.y);
                } else {
                    acc[i] += m.x * scales[i] * f32(d - i32(ZERO) * qsum);
                }
            }
        }
        var total: array<f32, WROWS>;
        for (var i = 0u; i < WROWS; i++) { total[i] = subgroupAdd(acc[i]); }
        if (lane.sg_lane == 0u) {
            for (var i = 0u; i < ROWS; i++) {
                let r = first + i;
                if (r < N) {
                    if (GATE_UP) {
                        y[r] = silu(total[i]) * total[ROWS + i];
                    } else {
                        y[r] = total[i];
                    }
                }
            }
        }
    }
}
