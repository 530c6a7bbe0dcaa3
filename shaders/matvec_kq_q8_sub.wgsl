// Decode matvec on Q2_K / Q3_K blocks with int8 activations (quantize_q8.wgsl's layout, or a norm's Q8 output):
// lanes on consecutive 64-element items of a row (kq_sub_items.wgsl: 16 code bytes, four 16-element sub-blocks whose
// scales are decoded once per item, integer sums through dot4I8Packed, the offsets through Σ xq per 16 elements).
// The activations come as element-order halves (kq_q8_halves.wgsl), staged once per workgroup with STAGE; a lane
// loads an item's four halves once and reuses them for its WROWS weight rows, whose words it loaded an item ahead.
// Each subgroup owns SPLIT · ROWS outputs (row blocks sg_id, sg_id + n_sg, ... of the workgroup's BLOCKS), its lanes
// cut into SPLIT segments of consecutive lanes, one per ROWS outputs, so a row of few items still keeps every lane
// busy (a subgroup smaller than SPLIT takes the segments in turn); a segment walks its rows' items and its sums meet
// through subgroupAdd. Needs subgroup ops. The older kernel, one chunk a lane: matvec_kq_q8_chunks.wgsl.
// Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, SPLIT, STAGE, GATE_UP (gate rows then up rows;
//   y = silu(gate)·up), KTYPE (10 or 11), QK, BW.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (SPLIT · ROWS · BLOCKS))).
#import reduce
#import kq_q8_halves
#import kq_sub_items
#import kq_q8_rows

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

const IPB: u32 = QK / 64u;     // items per block
const ITEMS: u32 = NB * IPB;   // items per row

// Item t of block bo's activations: sub-block k is half t%2 of chunk 8·bo + 4·(t/2) + k.
fn item_x(bo: u32, t: u32) -> SubX {
    var x: SubX;
    let h0 = 2u * (8u * bo + 4u * (t / 2u)) + t % 2u;
    for (var k = 0u; k < 4u; k++) {
        let h = x_half(h0 + 2u * k);
        x.codes[k] = h.codes;
        x.scale[k] = h.scale;
        x.sum[k] = h.sum;
        x.scaled_sum[k] = h.scale * f32(h.sum);
    }
    return x;
}

// The words of item `item` of the rows whose first blocks are blk0.
fn row_words(blk0: array<u32, WROWS>, item: u32) -> array<SubWords, WROWS> {
    var o: array<SubWords, WROWS>;
    for (var i = 0u; i < WROWS; i++) { o[i] = sub_words(blk0[i] + item / IPB, item % IPB); }
    return o;
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    let segs = min(SPLIT, lane.sg_size);  // powers of two: segs divides SPLIT and the subgroup
    let seg_lanes = lane.sg_size / segs;
    let seg = lane.sg_lane / seg_lanes;
    let lane0 = lane.sg_lane % seg_lanes;  // the lane's first item
    // Each item's words are loaded one item ahead; the first row set's first ones before the activation row is
    // staged, so they are in flight through it (rows past N clamp to N − 1; items past the row clamp to its last).
    let first0 = ((group_id * BLOCKS + lane.sg_id) * SPLIT + seg) * ROWS;
    var next = row_words(kq_row_blocks(first0), min(lane0, ITEMS - 1u));
    if (STAGE) { stage_halves(lane); }
    for (var blkrow = lane.sg_id; blkrow < BLOCKS; blkrow += lane.n_sg) {
        for (var turn = 0u; turn < SPLIT / segs; turn++) {
            let first = ((group_id * BLOCKS + blkrow) * SPLIT + turn * segs + seg) * ROWS;
            let blk0 = kq_row_blocks(first);
            if (first != first0) { next = row_words(blk0, min(lane0, ITEMS - 1u)); }
            var acc = array<f32, WROWS>();
            for (var item = lane0; item < ITEMS; item += seg_lanes) {
                let cur = next;
                if (item + seg_lanes < ITEMS) { next = row_words(blk0, item + seg_lanes); }
                let t = item % IPB;
                let x = item_x(item / IPB, t);
                for (var i = 0u; i < WROWS; i++) { acc[i] += sub_dot(cur[i], t, x); }
            }
            store_kq_segments(first, acc, lane, seg, segs, seg_lanes);
        }
    }
}
