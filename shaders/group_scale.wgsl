// The per-group f16 scale (and with AFFINE minimum) of packed weights, one per GROUP elements of a row along K:
// binding s holds f16[rows, K/GROUP], or (scale, min) pairs f16[rows, K/GROUP, 2] with AFFINE. The including kernel
// declares s and constants K, GROUP (a multiple of 32), AFFINE.

const GROUPS: u32 = K / GROUP;              // scale groups per row
const CPG: u32 = GROUP / 32u;               // 32-element chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);    // f16 per group in s: scale, or (scale, min)

// (scale, min) of weight row `row` at 32-element chunk `chunk` of K; min is 0 without AFFINE.
fn group_scale(row: u32, chunk: u32) -> vec2<f32> {
    let si = (row * GROUPS + chunk / CPG) * SPG;
    var out = vec2<f32>(f32(s[si]), 0.0);
    if (AFFINE) { out.y = f32(s[si + 1u]); }
    return out;
}
