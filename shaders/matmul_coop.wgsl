// Prefill GEMM on tensor cores (cooperative matrices): Y[t, n] = Σ_k X[t, k]·W[n, k], as matmul_int4.wgsl
// computes it (same bindings, constants, grid and GATE_UP / YS meaning), with f16 inputs and f32 accumulation.
// Only where the adapter offers cooperative-matrix; matmul_int4 is the fallback and the tested reference.
// A workgroup of 4 subgroups computes a 64×64 tile (64 tokens × 64 staged weight rows). Per 32-wide K step it
// stages X (f32 → f16, row-major [t][k]) and the dequantized weight rows (f16, [c][k]: the K×N operand in
// column-major order) in workgroup memory; subgroup sg multiplies tokens 32·(sg/2)..+32 by two 16-column
// fragments: 2×2 accumulators of 16×16, 8 multiply-adds per step. Its accumulators then pass through a 16×16
// scratch per fragment so ordinary stores can clip rows ≥ n_tokens and columns ≥ N and apply GATE_UP.
// With GATE_UP the staged rows are gate j0..j0+31 then up j0..j0+31, and a subgroup takes gate fragment f
// and up fragment f+2 (same output columns), so silu(gate)·up is formed from its own scratch.
// Constants: matmul_int4's (K, N, TM=64, TN=64 or 32 with GATE_UP, GATE_UP, YS, BITS, ZERO, AFFINE, GROUP)
//   plus SG, the subgroup size (the workgroup is 4·SG threads). Workgroup memory: 4 KiB X + 4 KiB W + 8 KiB
//   scratch.
// Bindings: 0 x f32[T, K] (read), 1 w u32 (read), 2 s f16 (read), 3 y f32[T, YS] (write), 4 step uniform.
enable wgpu_cooperative_matrix;
#import step

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const TK: u32 = 32u;
const CHUNKS: u32 = K / TK;
const QUANT: bool = BITS <= 8u;
const WPC: u32 = BITS;                      // u32 words per row per chunk
const EPW: u32 = 32u / BITS;                // elements per word
const MASK: u32 = (1u << BITS) - 1u;
const GROUPS: u32 = K / GROUP;
const CPG: u32 = GROUP / TK;
const SPG: u32 = select(1u, 2u, AFFINE);
const WN: u32 = 64u;                        // staged weight rows (TN outputs, or TN gate + TN up)
const WG: u32 = 4u * SG;
const N_TILES: u32 = (N + TN - 1u) / TN;

var<workgroup> x_tile: array<f16, 64u * TK>;   // [t][k]
var<workgroup> w_tile: array<f16, WN * TK>;    // [c][k]
var<workgroup> scratch: array<f32, 4u * 512u>; // per subgroup: two 16×16 fragments, row-major

fn weight_row(c: u32, j0: u32) -> u32 {
    if (GATE_UP) {
        return (c / TN) * N + min(j0 + c % TN, N - 1u);
    }
    return min(j0 + c, N - 1u);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
    let col_tile = wid.z * nwg.x + wid.x;
    let t0 = wid.y * 64u;
    if (col_tile >= N_TILES || t0 >= step.n_tokens) { return; }  // whole workgroup: barriers stay uniform
    let j0 = col_tile * TN;
    let last_t = step.n_tokens - 1u;
    let m_base = (sg / 2u) * 32u;             // this subgroup's token rows in the tile
    let f = sg % 2u;
    // Its two staged-column fragments: adjacent (2f, 2f+1), or with GATE_UP gate f and up f+2.
    let n_frag0 = select(2u * f, f, GATE_UP);
    let n_frag1 = select(2u * f + 1u, f + 2u, GATE_UP);

    var acc00: coop_mat16x16<f32, C>;
    var acc01: coop_mat16x16<f32, C>;
    var acc10: coop_mat16x16<f32, C>;
    var acc11: coop_mat16x16<f32, C>;
    for (var g = 0u; g < CHUNKS; g++) {
        // X: 64 rows × 8 vec4, rows past n_tokens clamped (computed, never written).
        for (var i = lid; i < 64u * 8u; i += WG) {
            let m = i / 8u;
            let kv = i % 8u;
            let v = x[min(t0 + m, last_t) * (K / 4u) + g * 8u + kv];
            let o = m * TK + kv * 4u;
            x_tile[o] = f16(v.x);
            x_tile[o + 1u] = f16(v.y);
            x_tile[o + 2u] = f16(v.z);
            x_tile[o + 3u] = f16(v.w);
        }
        // W: WN rows × WPC words; a thread dequantizes the EPW elements of one word.
        for (var i = lid; i < WN * WPC; i += WG) {
            let c = i / WPC;
            let word_in_chunk = i % WPC;
            let row = weight_row(c, j0);
            let word = w[(row * CHUNKS + g) * WPC + word_in_chunk];
            var scale = 1.0;
            var mn = 0.0;
            if (QUANT) {
                let si = (row * GROUPS + g / CPG) * SPG;
                scale = f32(s[si]);
                if (AFFINE) { mn = f32(s[si + 1u]); }
            }
            for (var e = 0u; e < EPW; e++) {
                var v = 0.0;
                if (!QUANT) {
                    v = unpack2x16float(word)[e];
                } else {
                    v = (f32((word >> (BITS * e)) & MASK) - f32(ZERO)) * scale + mn;
                }
                w_tile[c * TK + word_in_chunk * EPW + e] = f16(v);
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&x_tile[m_base * TK + kk], TK);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&x_tile[(m_base + 16u) * TK + kk], TK);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&w_tile[n_frag0 * 16u * TK + kk], TK);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&w_tile[n_frag1 * 16u * TK + kk], TK);
            acc00 = coopMultiplyAdd(a0, b0, acc00);
            acc01 = coopMultiplyAdd(a0, b1, acc01);
            acc10 = coopMultiplyAdd(a1, b0, acc10);
            acc11 = coopMultiplyAdd(a1, b1, acc11);
        }
        workgroupBarrier();
    }

    // Epilogue, one 16-row half at a time: both fragments to scratch, then plain clipped stores.
    let sc = sg * 512u;
    for (var half = 0u; half < 2u; half++) {
        if (half == 0u) {
            coopStoreT(acc00, &scratch[sc], 16u);
            coopStoreT(acc01, &scratch[sc + 256u], 16u);
        } else {
            coopStoreT(acc10, &scratch[sc], 16u);
            coopStoreT(acc11, &scratch[sc + 256u], 16u);
        }
        workgroupBarrier();
        for (var i = lane; i < 256u; i += SG) {
            let t = t0 + m_base + 16u * half + i / 16u;
            let col = i % 16u;
            if (t < step.n_tokens) {
                if (GATE_UP) {
                    let j = j0 + 16u * f + col;
                    if (j < N) { y[t * YS + j] = silu(scratch[sc + i]) * scratch[sc + 256u + i]; }
                } else {
                    let j0a = j0 + 16u * n_frag0 + col;
                    let j1a = j0 + 16u * n_frag1 + col;
                    if (j0a < N) { y[t * YS + j0a] = scratch[sc + i]; }
                    if (j1a < N) { y[t * YS + j1a] = scratch[sc + 256u + i]; }
                }
            }
        }
        workgroupBarrier();
    }
}
