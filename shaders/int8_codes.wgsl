// Weight codes as the signed int8 bytes dot4I8Packed takes (matmul_q8w, moe_gemm_q8): without AFFINE the zero point
// is subtracted here, once at staging, so the inner loop is dot4I8Packed and nothing else. The including kernel
// declares constants ZERO and AFFINE.

// The codes meet matvec_q8's byte order of the activation rows only: a model in element order never runs these.
const_assert !Q8_NATURAL;

const NIB: u32 = 0x0F0F0F0Fu;
const SIGN: u32 = 0x80808080u;
const ZERO4: u32 = ZERO * 0x01010101u;      // ZERO in each byte

// The 4 bytes of each u32 of `v` as signed int8 (v's bytes are 4-bit codes; without AFFINE minus ZERO): bytes
// 0x80 + q − ZERO stay in 1..0x8F (no borrow between bytes), and flipping bit 7 gives q − ZERO in two's complement.
fn codes(v: vec4<u32>) -> vec4<u32> {
    if (AFFINE) { return v; }
    return ((v | vec4<u32>(SIGN)) - vec4<u32>(ZERO4)) ^ vec4<u32>(SIGN);
}
