// The int8 tail of the norm kernels (rms_norm, add_rms_norm with Q8): the normed row that starts at `base` is
// computed from the kernel's own `norm_src(i)` (its input, or its residual sum), written to y, and stored in int8
// exactly as quantize_q8 would store it (q8_pack.wgsl's layout and rounding). All WG threads work on it: element i
// stays with thread i % WG (coalesced, as the f32 path), and chunk maxima, codes and sums meet through workgroup
// atomics. The including kernel declares w, y, xq, xm, NORM_OFFSET, norm_src and consts D (a multiple of 32,
// at most 8192) and WG. Call from uniform control flow (it has barriers).
#import q8_codes

const PER_THREAD: u32 = (D + WG - 1u) / WG;
// Sized 1 without Q8, so the f32 path keeps its workgroup memory small.
var<workgroup> q_amax: array<atomic<u32>, select(1u, D / 32u, Q8)>;  // bits of max |y| per chunk (non-negative
var<workgroup> q_sum: array<atomic<i32>, select(1u, D / 32u, Q8)>;   // floats order as their u32 bits)
var<workgroup> q_words: array<atomic<u32>, select(1u, D / 4u, Q8)>;

fn norm_row_q8(base: u32, inv: f32, lid: u32) {
    for (var k = lid; k < D / 4u; k += WG) { atomicStore(&q_words[k], 0u); }
    for (var c = lid; c < D / 32u; c += WG) {
        atomicStore(&q_amax[c], 0u);
        atomicStore(&q_sum[c], 0);
    }
    workgroupBarrier();
    var ys: array<f32, PER_THREAD>;
    for (var n = 0u; n < PER_THREAD; n++) {
        let i = lid + n * WG;
        if (i < D) {
            ys[n] = norm_src(base + i) * inv * (f32(w[i]) + NORM_OFFSET);
            y[base + i] = ys[n];
            atomicMax(&q_amax[i / 32u], bitcast<u32>(abs(ys[n])));
        }
    }
    workgroupBarrier();
    for (var n = 0u; n < PER_THREAD; n++) {
        let i = lid + n * WG;
        if (i < D) {
            let c = i / 32u;
            let e = i % 32u;
            let amax = bitcast<f32>(atomicLoad(&q_amax[c]));
            let q = i32(clamp(round(ys[n] * select(0.0, 127.0 / amax, amax > 0.0)), -127.0, 127.0));
            let at = q8_slot(e);  // element e's word and byte (q8_codes.wgsl: the model's order)
            atomicOr(&q_words[c * 8u + at.x], (u32(q) & 0xFFu) << (8u * at.y));
            atomicAdd(&q_sum[c], q);
        }
    }
    workgroupBarrier();
    for (var k = lid; k < D / 4u; k += WG) { xq[k] = atomicLoad(&q_words[k]); }
    for (var c = lid; c < D / 32u; c += WG) {
        xm[c] = vec2<f32>(bitcast<f32>(atomicLoad(&q_amax[c])) / 127.0, f32(atomicLoad(&q_sum[c])));
    }
}
