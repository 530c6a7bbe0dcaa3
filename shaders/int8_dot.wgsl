// The integer products of the int8-activation GEMMs (matmul_q8w, moe_gemm_q8): 16 activation bytes against 16
// weight bytes per dot16, four products a dot4I8Packed.

// i32 sums start at the bits of 1.5·2^23, so bitcast<f32>(sum) − 1.5·2^23 is the sum exactly (|sum| < 2^22):
// an FADD instead of an int-to-float conversion, which runs at a fraction of the FMA rate on NVIDIA GPUs.
const MAGIC: i32 = 0x4B400000;
const MAGIC_F: f32 = 12582912.0;

// One row's 16 activation bytes against the same 16 bytes of a weight column.
fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// The same 16 activation bytes against 4 weight columns.
fn dots(a: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>, b2: vec4<u32>, b3: vec4<u32>) -> vec4<i32> {
    return vec4<i32>(dot16(a, b0), dot16(a, b1), dot16(a, b2), dot16(a, b3));
}
