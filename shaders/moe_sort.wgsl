// Groups a prefill chunk's routing pairs by expert for the grouped expert GEMM (moe_gemm.wgsl): a counting sort in
// one workgroup. Pair p = t·SLOTS + s (token t, slot s in [SLOT0, SLOT0 + NSLOTS)) goes to expert
// e = min(ids[p], EXPERTS − 1) (clamped: a bad id sorts to a real expert). Counts come from workgroup atomics, their
// exclusive prefix sums give each expert's first position in `order`, and each expert's run is cut into tiles of
// at most TM pairs. Within an expert the pairs' order depends on atomic timing; no result depends on it (each
// output row of the GEMM is computed alone and written to its own pair's row).
// Streaming contract (issue 20): the expert is read from `ids` only, so a remap of ids to cache slots done before
// this kernel is what the GEMMs see.
// Constants: EXPERTS (experts in the stack, ≤ MAX_EXPERTS of engine/kernels/moe.py), SLOTS (slots per token in ids),
//   SLOT0, NSLOTS (the slots sorted), TM (pairs per tile), WG (a power of two).
// Bindings: 0 ids u32[T, SLOTS] (read), 1 order u32[T·NSLOTS] (write: pair indices grouped by expert),
//   2 tiles vec4<u32>[1 + max tiles] (write: tiles[0].x = tile count n; tile i at tiles[1 + i] = (expert, first
//   position in order, end position, 0)), 3 step uniform (n_tokens).
// Grid: (1, 1, 1).
#import step

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read_write> order: array<u32>;
@group(0) @binding(2) var<storage, read_write> tiles: array<vec4<u32>>;
@group(0) @binding(3) var<uniform> step: Step;

const PER: u32 = (EXPERTS + WG - 1u) / WG;  // experts per thread in the scan: lid·PER ..

var<workgroup> count: array<atomic<u32>, EXPERTS>;  // pairs per expert, then the scatter cursors
var<workgroup> first: array<u32, EXPERTS>;          // an expert's first position in order
var<workgroup> scan: array<vec2<u32>, WG>;          // (pairs, tiles) of each thread's experts, scanned

fn expert_of(i: u32) -> vec2<u32> {  // (expert, pair) of the i-th pair of this dispatch
    let p = (i / NSLOTS) * SLOTS + SLOT0 + i % NSLOTS;
    return vec2<u32>(min(ids[p], EXPERTS - 1u), p);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let pairs = step.n_tokens * NSLOTS;
    for (var e = lid; e < EXPERTS; e += WG) { atomicStore(&count[e], 0u); }
    workgroupBarrier();
    for (var i = lid; i < pairs; i += WG) { atomicAdd(&count[expert_of(i).x], 1u); }
    workgroupBarrier();

    // Inclusive scan of (pairs, tiles) over the threads' expert ranges (Hillis–Steele).
    var own = vec2<u32>(0u);
    for (var j = 0u; j < PER; j++) {
        let e = lid * PER + j;
        if (e < EXPERTS) {
            let c = atomicLoad(&count[e]);
            own += vec2<u32>(c, (c + TM - 1u) / TM);
        }
    }
    scan[lid] = own;
    workgroupBarrier();
    for (var d = 1u; d < WG; d *= 2u) {
        var v = scan[lid];
        if (lid >= d) { v += scan[lid - d]; }
        workgroupBarrier();
        scan[lid] = v;
        workgroupBarrier();
    }

    // Each thread writes its experts' tiles and first positions, and resets their counts to serve as cursors.
    var at = scan[lid] - own;  // exclusive: (position, tile index) of this thread's first expert
    for (var j = 0u; j < PER; j++) {
        let e = lid * PER + j;
        if (e < EXPERTS) {
            let c = atomicLoad(&count[e]);
            first[e] = at.x;
            for (var k = 0u; k < c; k += TM) {
                tiles[1u + at.y] = vec4<u32>(e, at.x + k, at.x + c, 0u);
                at.y += 1u;
            }
            at.x += c;
            atomicStore(&count[e], 0u);
        }
    }
    if (lid == WG - 1u) { tiles[0] = vec4<u32>(scan[lid].y, pairs, 0u, 0u); }
    workgroupBarrier();
    for (var i = lid; i < pairs; i += WG) {
        let ep = expert_of(i);
        order[first[ep.x] + atomicAdd(&count[ep.x], 1u)] = ep.y;
    }
}
