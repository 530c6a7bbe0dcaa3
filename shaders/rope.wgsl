// RoPE angle helper shared by the RoPE kernels. Needs a binding named inv_freq (f32[ROT/2]).

// 2π split so that k · TWO_PI_HI is exact in f32 for k < 2^15 (Cody–Waite range reduction).
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;

// (cos, sin) of p · inv_freq[i]. The angle is formed in f32 like transformers does, then reduced to
// [-π, π] before cos/sin: WGSL only bounds their error inside that range.
fn rope_cos_sin(p: u32, i: u32) -> vec2<f32> {
    let angle = f32(p) * inv_freq[i];
    let k = round(angle * 0.15915494309189535);
    let r = (angle - k * TWO_PI_HI) - k * TWO_PI_LO;
    return vec2<f32>(cos(r), sin(r));
}
