// The body of the int8-activation decode matvecs on Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 blocks (matvec_kq_q8,
// matvec_kq_q8_vec4: they differ only in how w is declared). Each subgroup owns ROWS outputs (row blocks sg_id,
// sg_id + n_sg, ... of the workgroup's BLOCKS, as matvec_q8.wgsl); its lanes take consecutive items of the rows
// (kq_items.wgsl), so the subgroup reads each row as one contiguous run of whole words, and meet through subgroupAdd.
// Per item a lane loads its parts' activations (quantize_q8's layout, q8_pack.wgsl) once, puts them in element order
// and reuses them for its WROWS weight rows; per row and part: Σ w·x = xs·(a·Σ u·xq + b·Σ xq), the integer sums
// exact through dot4I8Packed.
// With STAGE the kernels run kq_q8_rows_staged instead: the same sums, the activation row staged once per workgroup
// in element order (kq_q8_halves.wgsl) and each item's words loaded one item ahead.
// The including kernel declares xq (vec4<u32>), w, wh (f16), y (f32), xm (vec2<f32>), defines wv / ws
// (kq_items.wgsl) and imports reduce. Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, GATE_UP (gate rows then
// up rows; y = silu(gate)·up), HALVES (per-16 offsets), STAGE, BATCH (items a lane takes per pass of the unstaged
// loop, 1 the plain loop), KTYPE, QK, BW.
#import kq_items
#import q8_element_order
#import kq_q8_halves
#import kq_q8_rows

const ITEMS: u32 = NB * IPB;  // items per row

fn kq_q8_rows(group_id: u32, lane: Lane) {
    for (var blkrow = lane.sg_id; blkrow < BLOCKS; blkrow += lane.n_sg) {
        let first = (group_id * BLOCKS + blkrow) * ROWS;
        let blk0 = kq_row_blocks(first);
        var acc = array<f32, WROWS>();
        for (var item0 = lane.sg_lane; item0 < ITEMS; item0 += BATCH * lane.sg_size) {
          for (var u = 0u; u < BATCH; u++) {
            // BATCH items a lane at a time, none behind a branch (past the row: its last item, not summed), so
            // their loads can all be in flight together.
            let live = item0 + u * lane.sg_size < ITEMS;
            let item = min(item0 + u * lane.sg_size, ITEMS - 1u);
            let bo = item / IPB;
            let t = item % IPB;
            var xw: array<vec4<u32>, PARTS>;  // part p's 16 activation codes in element order
            var xs: array<f32, PARTS>;        // its chunk's activation scale
            var xb: array<f32, PARTS>;        // the Σ xq its offset b multiplies
            for (var p = 0u; p < PARTS; p++) {
                let ch = kq_part(t, p);
                let c = bo * CPB + ch.x;
                let v = xq[2u * c + ch.y];
                let m = xm[c];  // (activation scale, Σ xq over the chunk)
                xw[p] = vec4<u32>(in_order(v.x, v.y), in_order(v.z, v.w));
                xs[p] = m.x;
                if (HALVES) {
                    xb[p] = f32(dot4I8Packed(v.x, ONES) + dot4I8Packed(v.y, ONES) + dot4I8Packed(v.z, ONES)
                                + dot4I8Packed(v.w, ONES));
                } else {  // one offset per chunk: all of it on the half-0 part
                    xb[p] = select(0.0, m.y, ch.y == 0u);
                }
            }
            for (var i = 0u; i < WROWS; i++) {
                let it = kq_item(blk0[i] + bo, t);
                var s = 0.0;
                for (var p = 0u; p < PARTS; p++) {
                    let u = it.codes[p];
                    let x = xw[p];
                    let d = dot4I8Packed(u.x, x.x) + dot4I8Packed(u.y, x.y) + dot4I8Packed(u.z, x.z)
                          + dot4I8Packed(u.w, x.w);
                    s += xs[p] * (it.a[p] * f32(d) + it.b[p] * xb[p]);
                }
                acc[i] += select(0.0, s, live);
            }
          }
        }
        store_kq_rows(first, acc, lane);
    }
}

// The words of item `item` of the rows whose first blocks are blk0.
fn kq_row_words(blk0: array<u32, WROWS>, item: u32) -> array<KqWords, WROWS> {
    var o: array<KqWords, WROWS>;
    for (var i = 0u; i < WROWS; i++) { o[i] = kq_words(blk0[i] + item / IPB, item % IPB); }
    return o;
}

// kq_q8_rows with the activation row staged and each item's words loaded one item ahead (the first ones before the
// row is staged, in flight through it; rows past N clamp to N − 1, items past the row to its last). Each part's
// offset takes its own half's Σ xq: a chunk's b on both halves sums to b·Σ xq over the chunk. Call from uniform
// control flow (the staging ends in a workgroup barrier).
fn kq_q8_rows_staged(group_id: u32, lane: Lane) {
    let first0 = (group_id * BLOCKS + lane.sg_id) * ROWS;
    var next = kq_row_words(kq_row_blocks(first0), min(lane.sg_lane, ITEMS - 1u));
    stage_halves(lane);
    for (var blkrow = lane.sg_id; blkrow < BLOCKS; blkrow += lane.n_sg) {
        let first = (group_id * BLOCKS + blkrow) * ROWS;
        let blk0 = kq_row_blocks(first);
        if (first != first0) { next = kq_row_words(blk0, min(lane.sg_lane, ITEMS - 1u)); }
        var acc = array<f32, WROWS>();
        for (var item = lane.sg_lane; item < ITEMS; item += lane.sg_size) {
            let cur = next;
            if (item + lane.sg_size < ITEMS) { next = kq_row_words(blk0, item + lane.sg_size); }
            let bo = item / IPB;
            let t = item % IPB;
            var x: array<XHalf, PARTS>;
            for (var p = 0u; p < PARTS; p++) {
                let ch = kq_part(t, p);
                x[p] = x_half(2u * (bo * CPB + ch.x) + ch.y);
            }
            for (var i = 0u; i < WROWS; i++) {
                let it = kq_item_of(cur[i], t);
                var s = 0.0;
                for (var p = 0u; p < PARTS; p++) {
                    let u = it.codes[p];
                    let v = x[p].codes;
                    let d = dot4I8Packed(u.x, v.x) + dot4I8Packed(u.y, v.y) + dot4I8Packed(u.z, v.z)
                          + dot4I8Packed(u.w, v.w);
                    s += x[p].scale * (it.a[p] * f32(d) + it.b[p] * f32(x[p].sum));
                }
                acc[i] += s;
            }
        }
        store_kq_rows(first, acc, lane);
    }
}
