// Decode matvec on K-quant / Q5_0 / Q5_1 blocks read as stored, f32 activations (the exact path): y[n] = Σ_k W[n,k]·x[k].
// A workgroup owns ROWS outputs; each thread walks K one 32-element chunk at a time (chunks lid, lid + WG, ...), and
// per chunk loads its 8 x vec4 once and the code words and scales of every weight row of the workgroup, so 2·ROWS rows'
// loads are in flight with GATE_UP. Per row and half h of the chunk: a_h·Σ u·x + b_h·Σ x (kq_decode.wgsl's form), with
// Σ x per half shared by the rows. Partial sums meet through wg_sum4, four rows per call (as matvec_int4).
// Constants: K (a multiple of QK), N outputs, WG (a power of two), ROWS, LAST_ROW (read x row n_tokens − 1: the LM
//   head after a prefill), GATE_UP (W has 2N rows, gate then up; y = silu(gate)·up), KTYPE, QK, BW, BH, HALVES.
// Bindings: 0 x f32[T, K] (read), 1 w u32 q_blocks [N or 2N, K/QK·BW], 2 wh f16 (q_d, or q_blocks again),
//   3 y f32[N] (write), 4 step uniform (n_tokens). Grid: fold_grid(ceil(N / ROWS)).
#import step
#import reduce
#import kq_decode

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const CHUNKS: u32 = K / 32u;
const NB: u32 = K / QK;                      // blocks per row
const MATS: u32 = select(1u, 2u, GATE_UP);
const WROWS: u32 = ROWS * MATS;              // weight rows per workgroup: gate rows first, then up rows
const WROWS4: u32 = (WROWS + 3u) / 4u * 4u;  // padded to whole wg_sum4 calls
const N_GROUPS: u32 = (N + ROWS - 1u) / ROWS;

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let first = group_id * ROWS;
    let x_base = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (K / 4u);
    var blk0: array<u32, WROWS>;  // each weight row's first block; rows past N are clamped (summed, never written)
    for (var i = 0u; i < WROWS; i++) { blk0[i] = ((i / ROWS) * N + min(first + i % ROWS, N - 1u)) * NB; }

    var acc: array<f32, WROWS4>;
    for (var c = lane.lid; c < CHUNKS; c += WG) {
        let blk_off = c / CPB;
        let cc = c % CPB;
        var xs: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) { xs[j] = x[x_base + c * 8u + j]; }
        let s0 = xs[0] + xs[1] + xs[2] + xs[3];
        let s1 = xs[4] + xs[5] + xs[6] + xs[7];
        let xsum = vec2<f32>(s0.x + s0.y + s0.z + s0.w, s1.x + s1.y + s1.z + s1.w);
        for (var i = 0u; i < WROWS; i++) {
            let blk = blk0[i] + blk_off;
            let ab = kq_affine(blk, cc);
            var d0 = 0.0;
            var d1 = 0.0;
            for (var j = 0u; j < 4u; j++) {
                d0 += dot(kq_codes_f32(kq_word(blk, cc, j)), xs[j]);
                d1 += dot(kq_codes_f32(kq_word(blk, cc, j + 4u)), xs[j + 4u]);
            }
            acc[i] += ab.x * d0 + ab.y * d1 + ab.z * xsum.x + ab.w * xsum.y;
        }
    }

    for (var i = 0u; i < WROWS4; i += 4u) {
        let t = wg_sum4(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]), lane);
        acc[i] = t.x;
        acc[i + 1u] = t.y;
        acc[i + 2u] = t.z;
        acc[i + 3u] = t.w;
    }
    let i = lane.lid;
    let row = first + i;
    if (i < ROWS && row < N) {
        if (GATE_UP) {
            y[row] = silu(acc[i]) * acc[ROWS + i];
        } else {
            y[row] = acc[i];
        }
    }
}
