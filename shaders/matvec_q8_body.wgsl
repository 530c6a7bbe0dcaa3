// The body of the int8-activation decode matvecs (matvec_q8, moe_matvec_q8, ...): one subgroup computes ROWS outputs
// from 4-bit (or, BITS 3, MLX 3-bit) weight rows and one int8 activation row (q8_pack.wgsl's layout) through
// dot4I8Packed. Per 32-element chunk: Σ (q − ZERO)·x = xs·(Σ q·xq − ZERO·Σ xq), or with AFFINE
// Σ (s·q + m)·x = xs·(s·Σ q·xq + m·Σ xq).
// A 4-bit chunk is one vec4<u32> of a row; a 3-bit chunk is words 3c..3c+2 of the row's LSB-first bitstream (rows of
// 3K/32 words), read as three u32 so that a subgroup's lanes read one contiguous run of 12-byte chunks.
// The including kernel declares xq (vec4<u32>), w (vec4<u32>), s (f16), y (f32), xm (vec2<f32>) (bindings, or
// workgroup arrays the kernel fills) and imports reduce; constants K, N, ROWS, GATE_UP, BITS (4, or 3), ZERO, AFFINE, GROUP.

// The nibble-packed codes meet matvec_q8's byte order only: a model in element order never runs these kernels.
const_assert !Q8_NATURAL;

const CHUNKS: u32 = K / 32u;
const GROUPS: u32 = K / GROUP;
const CPG: u32 = GROUP / 32u;                // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);     // f16 per group: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);
const WROWS: u32 = ROWS * MATS;
const NIB: u32 = 0x0F0F0F0Fu;
const EVEN3: u32 = 0x1C71C7u;                // 3-bit fields at bits 0, 6, 12, 18 of a 24-bit run of 8 codes

// Chunk c of weight row `row` of the rows starting at u32 `wbase` of w (a multiple of 4): the vec4 of a 4-bit row,
// or with `three` the three words of a 3-bit row's chunk in .xyz.
fn chunk_words(row: u32, c: u32, three: bool, wbase: u32) -> vec4<u32> {
    if (three) {
        let b = wbase + (row * CHUNKS + c) * 3u;
        return vec4<u32>(w[b / 4u][b % 4u], w[(b + 1u) / 4u][(b + 1u) % 4u], w[(b + 2u) / 4u][(b + 2u) % 4u], 0u);
    }
    return w[wbase / 4u + row * CHUNKS + c];
}

// Fields at bits 0, 6, 12, 18 (3 bits each) moved to bytes 0..3.
fn spread3(v: u32) -> u32 {
    return (v & 7u) | ((v & 0x1C0u) << 2u) | ((v & 0x7000u) << 4u) | ((v & 0x1C0000u) << 6u);
}

// Σ q·xq over a 3-bit chunk: codes 8j..8j+7 are the 24 bits at 24j; its even codes meet activation u32 2j and its
// odd codes u32 2j + 1 (q8_pack's order), each as 4 bytes.
fn dot32_3(v: vec4<u32>, a: vec4<u32>, b: vec4<u32>) -> i32 {
    let r0 = v.x;
    let r1 = (v.x >> 24u) | (v.y << 8u);
    let r2 = (v.y >> 16u) | (v.z << 16u);
    let r3 = v.z >> 8u;
    return dot4I8Packed(spread3(r0 & EVEN3), a.x) + dot4I8Packed(spread3((r0 >> 3u) & EVEN3), a.y)
         + dot4I8Packed(spread3(r1 & EVEN3), a.z) + dot4I8Packed(spread3((r1 >> 3u) & EVEN3), a.w)
         + dot4I8Packed(spread3(r2 & EVEN3), b.x) + dot4I8Packed(spread3((r2 >> 3u) & EVEN3), b.y)
         + dot4I8Packed(spread3(r3 & EVEN3), b.z) + dot4I8Packed(spread3((r3 >> 3u) & EVEN3), b.w);
}

// Σ q·xq over one chunk: word j's even nibbles meet u32 2j of the chunk's activation bytes, odd ones u32 2j + 1.
fn dot32(v: vec4<u32>, a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(v.x & NIB, a.x) + dot4I8Packed((v.x >> 4u) & NIB, a.y)
         + dot4I8Packed(v.y & NIB, a.z) + dot4I8Packed((v.y >> 4u) & NIB, a.w)
         + dot4I8Packed(v.z & NIB, b.x) + dot4I8Packed((v.z >> 4u) & NIB, b.y)
         + dot4I8Packed(v.w & NIB, b.z) + dot4I8Packed((v.w >> 4u) & NIB, b.w);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

const ROW_BATCH: u32 = 8u;  // chunks whose weight loads q8_row_dot issues before their math

// Σ over every chunk of weight row `row` times activation row xrow, by one thread (kernels in which a thread owns a
// whole row: moe_down_q8.wgsl): q8_block's arithmetic per chunk, its chunks summed in order, the weights and scales
// of ROW_BATCH chunks loaded before any of their math (so they are in flight together).
fn q8_row_dot(row: u32, xrow: u32, three: bool, wbase: u32, sbase: u32) -> f32 {
    var acc = 0.0;
    for (var c0 = 0u; c0 < CHUNKS; c0 += ROW_BATCH) {
        var words: array<vec4<u32>, ROW_BATCH>;
        var scales: array<f32, ROW_BATCH>;
        var mins: array<f32, ROW_BATCH>;
        for (var j = 0u; j < ROW_BATCH; j++) {
            let c = min(c0 + j, CHUNKS - 1u);  // past the row's end: the last chunk again, loaded, never summed
            words[j] = chunk_words(row, c, three, wbase);
            let si = sbase + (row * GROUPS + c / CPG) * SPG;
            scales[j] = f32(s[si]);
            if (AFFINE) { mins[j] = f32(s[si + 1u]); }
        }
        for (var j = 0u; j < ROW_BATCH && c0 + j < CHUNKS; j++) {
            let xc = xrow * CHUNKS + c0 + j;
            let m = xm[xc];  // (activation scale, Σ xq)
            let a = xq[2u * xc];
            let b = xq[2u * xc + 1u];
            var d: i32;
            if (three) { d = dot32_3(words[j], a, b); } else { d = dot32(words[j], a, b); }
            if (AFFINE) {
                acc += m.x * (scales[j] * f32(d) + mins[j] * m.y);
            } else {
                acc += m.x * scales[j] * f32(d - i32(ZERO) * i32(m.y));
            }
        }
    }
    return acc;
}

// Outputs first .. first + ROWS of the matrix whose weight rows start at row0 (gate rows, then up rows with
// GATE_UP), from int8 activation row xrow, written to y[y_base + first + i]. The rows are 3-bit with `three` (else
// 4-bit) and counted from u32 wbase of w and f16 sbase of s. Call from subgroup-uniform flow.
fn q8_block(first: u32, row0: u32, xrow: u32, y_base: u32, lane: Lane, three: bool, wbase: u32, sbase: u32) {
    q8_block_scaled(first, row0, xrow, y_base, 1.0, lane, three, wbase, sbase);
}

// q8_block with every dot product times `scale` (before the gate's SiLU): an activation row stored in int8 without
// a factor common to all its chunks (an RMSNorm's 1/rms: matvec_q8_rms.wgsl).
fn q8_block_scaled(first: u32, row0: u32, xrow: u32, y_base: u32, scale: f32, lane: Lane, three: bool, wbase: u32,
                   sbase: u32) {
    let sums = q8_block_sums(first, row0, xrow, lane, three, wbase, sbase, 0u, CHUNKS);
    var total: array<f32, WROWS>;
    for (var i = 0u; i < WROWS; i++) { total[i] = sums[i] * scale; }
    if (lane.sg_lane == 0u) {
        for (var i = 0u; i < ROWS; i++) {
            let r = first + i;
            if (r < N) {
                if (GATE_UP) {
                    y[y_base + r] = silu(total[i]) * total[ROWS + i];
                } else {
                    y[y_base + r] = total[i];
                }
            }
        }
    }
}

// The subgroup's sums (in every lane) of q8_block's WROWS weight rows over chunks c_begin .. c_end of K (all of them:
// q8_block; a part of K: a split-K workgroup, matvec_q8_norm_split.wgsl). Call from subgroup-uniform flow.
fn q8_block_sums(first: u32, row0: u32, xrow: u32, lane: Lane, three: bool, wbase: u32, sbase: u32, c_begin: u32,
                 c_end: u32) -> array<f32, WROWS> {
    var row: array<u32, WROWS>;  // rows past N are clamped to N - 1: read, summed, never written
    for (var i = 0u; i < WROWS; i++) { row[i] = row0 + (i / ROWS) * N + min(first + i % ROWS, N - 1u); }
    var acc = array<f32, WROWS>();
    for (var c = c_begin + lane.sg_lane; c < c_end; c += lane.sg_size) {
        var words: array<vec4<u32>, WROWS>;
        var scales: array<f32, WROWS>;
        var mins: array<f32, WROWS>;
        for (var i = 0u; i < WROWS; i++) {
            words[i] = chunk_words(row[i], c, three, wbase);
            let si = sbase + (row[i] * GROUPS + c / CPG) * SPG;
            scales[i] = f32(s[si]);
            if (AFFINE) { mins[i] = f32(s[si + 1u]); }
        }
        let xc = xrow * CHUNKS + c;
        let a = xq[2u * xc];
        let b = xq[2u * xc + 1u];
        let m = xm[xc];  // (activation scale, Σ xq)
        let qsum = i32(m.y);
        for (var i = 0u; i < WROWS; i++) {
            var d: i32;
            if (three) { d = dot32_3(words[i], a, b); } else { d = dot32(words[i], a, b); }
            if (AFFINE) {
                acc[i] += m.x * (scales[i] * f32(d) + mins[i] * m.y);
            } else {
                acc[i] += m.x * scales[i] * f32(d - i32(ZERO) * qsum);
            }
        }
    }
    var total: array<f32, WROWS>;
    for (var i = 0u; i < WROWS; i++) { total[i] = subgroupAdd(acc[i]); }
    return total;
}
