"""gdn_conv's token-parallel plan (a workgroup's threads split each channel's tokens into RUNS runs) against the
one-run plan (one thread per channel walks the chunk) bit for bit, and against float64: T not a multiple of RUNS,
runs shorter than the conv's history (they read the state), empty runs, the state carried in and out across
forwards, pos0 == 0 ignoring the state, and a grid folded past 65,535 workgroups."""

import numpy as np
import pytest

from engine.bench_hybrid import hybrid_spec
from engine.kernels.gdn import CONV_MAX_RUNS, gdn_conv_plan, gdn_conv_runs
from engine.runtime_options import RuntimeOptions
from engine.transformer import RuntimePlan
from tests.helpers import conv_ref, poisoned, read, run, softplus, step_uniform

VH = 5  # value heads whose gates the dispatch computes beside the conv


def conv_inputs(rng, T, CONV, PAD, KC, pos0):
    """Random in_proj rows (conv channels, then a and b columns), conv weights, state, A_log and dt_bias."""
    ROW = CONV + PAD + 2 * VH
    x = rng.standard_normal((T, ROW)).astype(np.float32)
    w = rng.standard_normal((CONV, KC)).astype(np.float16)
    state = rng.standard_normal((KC - 1, CONV)).astype(np.float32)
    if pos0 == 0:
        state[:] = np.nan  # a fresh sequence must not read the state at all
    a_log = np.log(rng.uniform(0.01, 16, VH)).astype(np.float32)
    dt_bias = rng.standard_normal(VH).astype(np.float32)
    return x, w, state, a_log, dt_bias


def conv_plan(CONV, ROW, KC, runs, wg=None):
    return gdn_conv_plan(CONV, ROW, KC, VH, ROW - 2 * VH, ROW - VH, runs=runs, wg=wg)


def run_conv(gpu, plan, x, wb, st, pos0, a_log, dt_bias):
    """One forward of len(x) tokens at pos0 on state buffer `st`: (y, gates), from NaN-poisoned outputs."""
    (consts, grid), (T, CONV) = plan, (len(x), plan[0]["CONV"])
    y, gates = poisoned(gpu, "y", (T, CONV)), poisoned(gpu, "gates", (T, 2 * VH))
    run(gpu, "gdn_conv", consts, [gpu.upload("x", x), wb, st, y, step_uniform(gpu, T, pos0),
                                  gpu.upload("a_log", a_log), gpu.upload("dt", dt_bias), gates], grid)
    return read(gpu, y, (T, CONV)), read(gpu, gates, (T, 2 * VH))


def gates_ref(x, a_log, dt_bias):
    a = x[:, -2 * VH:-VH].astype(np.float64) + dt_bias
    return -np.exp(a_log.astype(np.float64)) * softplus(a), 1 / (1 + np.exp(-x[:, -VH:].astype(np.float64)))


@pytest.mark.parametrize("CONV,PAD,KC,T,pos0,RUNS,WG", [
    (256, 40, 4, 513, 7, 32, None),  # runs of 17: the last run is empty
    (100, 0, 4, 70, 3, 8, None),  # a part-filled last workgroup
    (96, 8, 4, 3, 1, 8, None),  # runs of one token read the state (positions before 0 as zero)
    (64, 4, 4, 1, 5, 16, None),  # a decode token on the runs plan
    (70, 6, 3, 70, 0, 4, None),  # fresh sequence: a NaN state must not leak
    (48, 0, 2, 5, 2, 3, None),  # RUNS not a power of two (255 threads)
    (64, 0, 4, 2, 0, 32, None),  # T < KC − 1: the state written back holds zeros before position 0
    (65600, 0, 4, 3, 4, 32, 32),  # one channel a workgroup: 65,600 workgroups fold into (x, y)
])
def test_runs_equal_one_run_and_float64(gpu, rng, CONV, PAD, KC, T, pos0, RUNS, WG):
    x, w, state, a_log, dt_bias = conv_inputs(rng, T, CONV, PAD, KC, pos0)
    ROW, wb = x.shape[1], gpu.upload("w", w)
    runs_plan = conv_plan(CONV, ROW, KC, RUNS, WG)
    assert (CONV < 65536) == (runs_plan[1][1] == 1)
    outs = []
    for plan in (conv_plan(CONV, ROW, KC, 1), runs_plan):
        st = gpu.upload("state", state)
        outs.append((*run_conv(gpu, plan, x, wb, st, pos0, a_log, dt_bias), read(gpu, st, (KC - 1, CONV))))
    (y1, g1, s1), (y, g, s) = outs
    np.testing.assert_array_equal(y, y1)
    np.testing.assert_array_equal(g, g1)
    np.testing.assert_array_equal(s, s1)
    y_ref, state_ref = conv_ref(x[:, :CONV], w, state, pos0)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s, state_ref.astype(np.float32))  # raw inputs: copied, never rounded
    g_ref, beta_ref = gates_ref(x, a_log, dt_bias)
    np.testing.assert_allclose(g[:, :VH], g_ref, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(g[:, VH:], beta_ref, rtol=2e-6, atol=1e-7)


def test_runs_carry_the_state_as_one_pass(gpu, rng):
    """Forwards of 513, 1, 3, 70 and 2 tokens on the runs plan equal one 589-token forward on the one-run plan."""
    CONV, KC, parts = 72, 4, (513, 1, 3, 70, 2)
    x, w, state, a_log, dt_bias = conv_inputs(rng, sum(parts), CONV, 0, KC, 0)
    ROW, wb = x.shape[1], gpu.upload("w", w)
    st = gpu.upload("state", state)
    whole_y, whole_g = run_conv(gpu, conv_plan(CONV, ROW, KC, 1), x, wb, st, 0, a_log, dt_bias)
    whole_state = read(gpu, st, (KC - 1, CONV))
    st, pos, ys, gs = gpu.upload("state", state), 0, [], []
    for n in parts:
        y, g = run_conv(gpu, conv_plan(CONV, ROW, KC, 8), x[pos:pos + n], wb, st, pos, a_log, dt_bias)
        ys.append(y)
        gs.append(g)
        pos += n
    np.testing.assert_array_equal(np.concatenate(ys), whole_y)
    np.testing.assert_array_equal(np.concatenate(gs), whole_g)
    np.testing.assert_array_equal(read(gpu, st, (KC - 1, CONV)), whole_state)
    np.testing.assert_array_equal(whole_state, x[-(KC - 1):, :CONV])


def test_runs_for_a_chunk():
    """About 16 tokens a thread at a full chunk, in a power-of-two count of runs, capped."""
    assert [gdn_conv_runs(c) for c in (1, 16, 17, 32, 64, 100, 512, 4096)] == [1, 1, 2, 2, 4, 8, 32, CONV_MAX_RUNS]


def test_conv_plan_limits():
    consts, grid = gdn_conv_plan(8192, 12352, 4, 32, 12288, 12320, runs=32)
    assert (consts["WG"], consts["RUNS"], grid) == (256, 32, (1024, 1))  # 8 channels a workgroup
    consts, grid = gdn_conv_plan(8192, 12352, 4, 32, 12288, 12320)
    assert (consts["WG"], consts["RUNS"], grid) == (64, 1, (128, 1))  # decode: one thread per channel
    assert gdn_conv_plan(64, 64, 4, 1, 0, 1, runs=3)[0]["WG"] == 255
    assert gdn_conv_plan(64, 64, 4, 1, 0, 1, runs=256)[0]["WG"] == 256
    for bad in (dict(runs=257), dict(runs=4, wg=512), dict(runs=3, wg=64), dict(runs=0)):
        with pytest.raises(ValueError, match="RUNS"):
            gdn_conv_plan(64, 64, 4, 1, 0, 1, **bad)


def test_runs_option_reaches_the_mixer():
    """RuntimeOptions.gdn_conv_runs picks the prefill plan (None: the chunk's default; 1: the one-run plan)."""
    spec, formats = hybrid_spec("qwen3.5-4b")

    def runs(**options):
        plan = RuntimePlan(spec, formats, RuntimeOptions(max_context=1024, **options))
        return {b.conv_runs for b in plan.blocks if b.name == "gated_deltanet"}

    assert runs() == {gdn_conv_runs(512)} and runs(prefill_chunk=64) == {4}
    assert runs(gdn_conv_runs=1) == {1} and runs(gdn_conv_runs=5) == {5}
    for bad in (0, 257, True, 2.0):
        with pytest.raises(ValueError, match="gdn_conv_runs"):
            RuntimeOptions(gdn_conv_runs=bad)
