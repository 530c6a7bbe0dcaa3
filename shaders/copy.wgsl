// Bandwidth probe: dst = src, vec4<u32> at a time; each thread copies PER_THREAD vectors spaced a grid-width apart
// so neighbouring threads touch neighbouring addresses. Used by `zerotvm bench` for the copy-kernel ceiling.
// Constants: WG, PER_THREAD, N4 (vec4 count), GRID_X (folded grid width). Bindings: 0 src (read), 1 dst (write).

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wid.y * GRID_X + wid.x;
    let base = group * WG * PER_THREAD + lid;
    for (var j = 0u; j < PER_THREAD; j++) {
        let i = base + j * WG;
        if (i < N4) { dst[i] = src[i]; }
    }
}
