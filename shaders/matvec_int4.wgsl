// Decode matvec on q4f16_1 weights: y[n] = Σ_k W[n, k]·x[k] for one activation row, f32 accumulate.
// A workgroup owns ROWS outputs. Each thread walks K one 32-element group at a time: per group it loads
// one vec4<u32> (32 nibbles) and one f16 scale for every weight row of the workgroup before doing any
// math, so ROWS (2·ROWS with GATE_UP) independent loads are in flight, and reuses the 8 vec4 of x
// across them. Partial sums meet through wg_sum4, four rows per call.
// Constants: K (multiple of 32), N outputs, WG threads (a power of two for the workgroup-memory
//   reduction), ROWS outputs per workgroup, LAST_ROW (read x row n_tokens-1 instead of row 0: the LM
//   head after a prefill), GATE_UP (W has 2N rows, gate [0, N) then up [N, 2N); y[j] = silu(gate_j)·up_j).
// Bindings: 0 x f32[T, K] (read), 1 w u32[N or 2N, K/8] (read), 2 s f16[N or 2N, K/32] (read),
//   3 y f32[N] (write), 4 step uniform (n_tokens).
// Grid: fold_grid(ceil(N / ROWS)); the workgroup id is rebuilt from (x, y).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const GROUPS: u32 = K / 32u;                 // scale groups per row = vec4<u32> words per row
const MATS: u32 = select(1u, 2u, GATE_UP);   // weight rows per output
const SLOTS: u32 = ROWS * MATS;              // weight rows per workgroup: gate rows first, then up rows
const SLOTS4: u32 = (SLOTS + 3u) / 4u * 4u;  // padded to whole wg_sum4 calls
const N_GROUPS: u32 = (N + ROWS - 1u) / ROWS;
const MAGIC: u32 = 0x4B000000u;              // bits of 2^23: a nibble OR-ed in is 2^23 + q exactly
const MAGIC_PLUS_7: f32 = 8388615.0;         // 2^23 + 7

// Σ (q_i − 7)·x_i over the 8 nibbles of one word (element i at bits 4i). The nibble goes into the
// mantissa of 2^23 instead of through an int→float conversion; both steps are exact.
fn dot8(word: u32, lo: vec4<f32>, hi: vec4<f32>) -> f32 {
    let q_lo = ((vec4<u32>(word) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u)) | vec4<u32>(MAGIC);
    let q_hi = ((vec4<u32>(word) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u)) | vec4<u32>(MAGIC);
    return dot(bitcast<vec4<f32>>(q_lo) - MAGIC_PLUS_7, lo) + dot(bitcast<vec4<f32>>(q_hi) - MAGIC_PLUS_7, hi);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let first = group_id * ROWS;
    let x_row = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW);
    let x_base = x_row * (K / 4u);

    // Rows past N are clamped to N-1: they load real data and join the reduction, but are not written.
    var w_base: array<u32, SLOTS>;
    for (var i = 0u; i < SLOTS; i++) {
        w_base[i] = ((i / ROWS) * N + min(first + i % ROWS, N - 1u)) * GROUPS;
    }

    var acc: array<f32, SLOTS4>;
    for (var g = lane.lid; g < GROUPS; g += WG) {
        var words: array<vec4<u32>, SLOTS>;
        var scales: array<f32, SLOTS>;
        for (var i = 0u; i < SLOTS; i++) {
            words[i] = w[w_base[i] + g];
            scales[i] = f32(s[w_base[i] + g]);
        }
        let xb = x_base + g * 8u;
        let x0 = x[xb];
        let x1 = x[xb + 1u];
        let x2 = x[xb + 2u];
        let x3 = x[xb + 3u];
        let x4 = x[xb + 4u];
        let x5 = x[xb + 5u];
        let x6 = x[xb + 6u];
        let x7 = x[xb + 7u];
        for (var i = 0u; i < SLOTS; i++) {
            let q = words[i];
            acc[i] += scales[i] * (dot8(q.x, x0, x1) + dot8(q.y, x2, x3) + dot8(q.z, x4, x5) + dot8(q.w, x6, x7));
        }
    }

    var total: array<f32, SLOTS4>;
    for (var i = 0u; i < SLOTS4; i += 4u) {
        let t = wg_sum4(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]), lane);
        total[i] = t.x;
        total[i + 1u] = t.y;
        total[i + 2u] = t.z;
        total[i + 3u] = t.w;
    }

    let row = first + lane.lid;
    if (lane.lid < ROWS && row < N) {
        if (GATE_UP) {
            y[row] = silu(total[lane.lid]) * total[ROWS + lane.lid];
        } else {
            y[row] = total[lane.lid];
        }
    }
}
