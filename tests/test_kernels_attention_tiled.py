"""The tiled prefill attention (attention_tiled.wgsl) vs float64 numpy: 32-row query tiles and 32-key blocks crossed,
causal masking at a chunk offset (pos0 > 0), GQA heads sharing a workgroup, and the plan's head grouping."""

import numpy as np
import pytest

from engine.kernels.attention import attention_tiled_grid, attention_tiled_plan
from tests.helpers import PAGE, AttentionSetup, attention_ref, poisoned, read, run, step_uniform


@pytest.mark.parametrize(
    "H,KVH,HD,T,pos0",
    [
        (3, 3, 96, 37, 0),  # MHA (Phi-3's head): two token tiles, the second partly empty
        (8, 2, 128, 20, 45),  # GQA group 4 (4 heads × 8 tokens a tile), a second chunk: 65 keys, 3 blocks
        (6, 2, 64, 9, 30),  # group 3: one head a tile
        (2, 1, 256, 5, 3),  # widest head, group 2
        (32, 2, 32, 3, 70),  # group 16: 2 tokens a tile
    ],
)
def test_tiled_attention(gpu, rng, H, KVH, HD, T, pos0):
    a = AttentionSetup(gpu, rng, H, KVH, HD, T, pos0)
    consts = attention_tiled_plan(H, KVH, HD, PAGE)
    out = poisoned(gpu, "out", (T + 1, H * HD))  # one row past T must stay untouched
    unused = [gpu.buffer("xq", 16), gpu.buffer("xm", 16)]  # the int8 rows (ROWS_Q8 is off)
    run(gpu, "attention_tiled", consts, a.bufs + [out, step_uniform(gpu, T, pos0), *unused],
        attention_tiled_grid(consts, T))
    got = read(gpu, out, (T + 1, H * HD))
    np.testing.assert_allclose(got[:T], attention_ref(a.q, a.k, a.v, pos0, a.scale), rtol=1e-4, atol=1e-5)
    assert np.isnan(got[T]).all()


def test_tiled_plan_groups_heads():
    assert attention_tiled_plan(32, 32, 96, PAGE)["HG"] == 1  # Phi-3
    assert attention_tiled_plan(32, 8, 128, PAGE)["HG"] == 4  # Qwen3-4B
    assert attention_tiled_plan(28, 4, 128, PAGE)["HG"] == 1  # group 7
    assert attention_tiled_plan(64, 1, 64, PAGE)["HG"] == 32  # group 64: at most the tile's 32 rows
    assert attention_tiled_plan(8, 2, 80, PAGE) is None  # head_dim not a multiple of 32: the per-token kernel
    assert attention_tiled_grid(attention_tiled_plan(32, 8, 128, PAGE), 512) == (8, 64, 1)
