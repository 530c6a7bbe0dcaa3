"""Routed experts streamed from host memory through a GPU expert cache (engine/blocks/expert_cache.py): a tiny MLX
MoE under a weights budget that forces misses gives the same logits and greedy tokens, bit for bit, as the resident
model (prefill in batches of cached experts, int8 and f32 decode); the slot map's eviction; the budget's errors
and its spelling (--gpu-weights, ZEROTVM_GPU_WEIGHTS)."""

import numpy as np
import pytest

from engine.blocks.expert_cache import SlotMap, _runs
from engine.errors import GpuError
from engine.gpu_budget import auto_budget, from_env, parse_size
from engine.model import load_model
from engine.sampling import SamplingParams
from tests.helpers import assert_recorded_count, cached_mlx

KW = dict(max_context=320, prefill_chunk=32, split_keys=48)

# ---- the budget's spelling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("123", 123), ("1K", 1024), ("512M", 512 * 2**20), ("12G", 12 * 2**30),
                                         ("1.5G", 3 * 2**29), ("8GiB", 8 * 2**30), ("64 MB", 64 * 2**20),
                                         ("auto", None), ("", None), (None, None), (4096, 4096)])
def test_sizes_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12X", "-1G", "0", "G", "1e9", "twelve", "0.0001K", "2000T"])
def test_bad_sizes_are_named(text):
    with pytest.raises(ValueError, match="--gpu-weights"):
        parse_size(text)


def test_environment_budget():
    assert from_env({"ZEROTVM_GPU_WEIGHTS": "10G"}) == 10 * 2**30
    assert from_env({}) is None
    with pytest.raises(ValueError, match="ZEROTVM_GPU_WEIGHTS"):
        from_env({"ZEROTVM_GPU_WEIGHTS": "lots"})


def test_auto_budget_leaves_the_other_buffers_and_a_margin():
    assert auto_budget(None, 10) is None
    assert auto_budget(24 * 2**30, 4 * 2**30) == 24 * 2**30 - 4 * 2**30 - int(24 * 2**30 * 0.05)
    assert auto_budget(8 * 2**30, 2**30) == 7 * 2**30 - 768 * 2**20  # the fixed margin on a small card


def test_cli_refuses_a_bad_budget(capsys):
    from engine.cli import main

    assert main(["logits", "nowhere", "--ids", "1", "--gpu-weights", "12X"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-weights" in err and "12X" in err and "Traceback" not in err


# ---- the slot map ------------------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recent_and_counts():
    m = SlotMap(8, 3, "lru")
    where, loads = m.assign([0, 1])
    assert loads == [(0, 0), (1, 1)] and (m.hits, m.misses) == (0, 2)
    m.assign([2])
    where, loads = m.assign([0, 3])  # 1 is the least recent: 3 takes its slot
    assert where == {0: 0, 3: 1} and loads == [(3, 1)] and (m.hits, m.misses) == (1, 4)
    where, loads = m.assign([2, 3])  # both resident
    assert loads == [] and m.hits == 3


def test_lfu_keeps_the_most_used_and_never_evicts_what_is_asked_for():
    m = SlotMap(8, 2, "lfu")
    for _ in range(3):
        m.assign([5])
    m.assign([6])
    where, loads = m.assign([7])  # 6 (used once) goes, 5 (three times) stays
    assert loads == [(7, where[7])] and 5 in m.where and 6 not in m.where
    where, loads = m.assign([6, 7])  # 7 is asked for with 6: 5 has to go, however popular
    assert set(where) == {6, 7} and 5 not in m.where
    with pytest.raises(ValueError, match="2 slots"):
        m.assign([1, 2, 3])


def test_batches_put_resident_experts_first():
    m = SlotMap(8, 3)
    m.assign([4, 6])
    assert m.batches([1, 6, 2, 4, 1, 7]) == [[6, 4, 1], [2, 7]]


def test_gather_reads_experts_of_mapped_and_joined_stacks(tmp_path):
    from engine.blocks.expert_cache import _gather
    from engine.formats.mlx_layout import RowJoin

    rng = np.random.default_rng(0)
    gate, up = (rng.integers(0, 2**32, (6, 3, 4), dtype=np.uint32) for _ in range(2))
    for name, a in (("gate", gate), ("up", up)):
        a.tofile(tmp_path / name)
    mapped = [np.memmap(tmp_path / n, np.uint32, "r", shape=(6, 3, 4)) for n in ("gate", "up")]
    ids = np.array([4, 1, 5])
    joined = np.concatenate([gate, up], axis=1)
    assert np.array_equal(np.asarray(RowJoin(mapped)), joined)
    assert _gather(RowJoin(mapped), ids).tobytes() == joined[ids].tobytes()
    out = np.zeros(8 + 3 * 48, np.uint8)
    _gather(mapped[0], ids, out[8:])  # into a slice (the mapped staging at an offset)
    assert out[8:].tobytes() == gate[ids].tobytes() and not out[:8].any()


def test_gather_on_threads_splits_by_experts(monkeypatch):
    from engine.blocks import expert_cache

    monkeypatch.setattr(expert_cache, "MIN_THREAD_BYTES", 1)
    monkeypatch.setattr(expert_cache, "GATHER_THREADS", 3)
    rng = np.random.default_rng(1)
    stacks = [rng.integers(0, 2**32, (9, 5, 4), dtype=np.uint32), rng.standard_normal((9, 7)).astype(np.float16)]
    ids = np.array([8, 0, 3, 4, 7, 2, 1])
    outs = [np.zeros(len(ids) * (a.nbytes // 9), np.uint8) for a in stacks]
    expert_cache._gather_all([(a, ids, o) for a, o in zip(stacks, outs, strict=True)])
    for a, o in zip(stacks, outs, strict=True):
        assert o.tobytes() == a[ids].tobytes()


def test_runs_of_consecutive_slots():
    assert _runs([0, 1, 2, 5, 7, 8]) == [(0, 0, 3), (3, 5, 1), (4, 7, 2)]


# ---- the tiny MLX MoE: 4 MoE layers of 8 experts, top-2, the shared expert stacked ------------------------------


def budgets(model, slots: int) -> int:
    """The weights budget that leaves `slots` cache slots per layer."""
    moe = model.runtime.block("moe")
    weights = model.runtime.plan.memory()["weights"]
    return weights - (moe.E - slots) * moe.routed_expert_bytes()


@pytest.fixture(scope="module", params=["q4", "q3exp"])
def pair(gpu, request):
    """(resident, streamed with 3 of 8 experts a layer on the GPU), f32 decode."""
    path = cached_mlx(request.param)
    resident = load_model(path, gpu=gpu, q8_decode=False, **KW)
    streamed = load_model(path, gpu=gpu, q8_decode=False, gpu_weights=budgets(resident, 3), **KW)
    return resident, streamed


@pytest.mark.slow
def test_streamed_logits_equal_resident(pair):
    """A prefill chunk of 32 tokens routes to all 8 experts, so it runs in three batches of cached experts."""
    resident, streamed = pair
    st = streamed.runtime.plan.streaming
    assert st is not None and st.slots == 3 and resident.runtime.plan.streaming is None
    ids = np.random.default_rng(0).integers(0, resident.runtime.spec.vocab, 70)
    before = st.misses
    assert np.array_equal(streamed.logits(ids), resident.logits(ids))
    assert st.misses - before > 8 * 4  # each layer loaded more experts than it has slots: evicted and refilled
    for rt in (streamed.runtime, resident.runtime):  # one row a forward: the decode kernels
        rt.reset()
    assert np.array_equal(streamed.runtime.logits(ids[:20], chunk=1), resident.runtime.logits(ids[:20], chunk=1))


def greedy(model, prompt, n):
    rt = model.runtime
    rt.reset()
    rt.set_sampling(SamplingParams())
    rt.prefill(prompt)
    first = rt.read_sampled(0)
    return [first] + [t for batch in rt.decode(0, n - 1) for t in batch]


@pytest.mark.slow
def test_streamed_greedy_decode_equals_resident(pair):
    resident, streamed = pair
    st = streamed.runtime.plan.streaming
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, 40)]
    hits, misses = st.hits, st.misses
    assert greedy(streamed, prompt, 40) == greedy(resident, prompt, 40)
    assert st.hits > hits and st.misses > misses


@pytest.mark.slow
def test_streamed_rollback_follow_up_and_sampling_equal_resident(pair):
    """Rollback to a recurrent-state snapshot, a follow-up turn on the reused cache and a sampled reply: the streamed
    model's tokens and logits are the resident model's."""
    resident, streamed = pair
    seq = np.random.default_rng(4).integers(3, 250, 90).tolist()
    got = []
    for m in (streamed, resident):
        rt = m.runtime
        rt.reset()
        rt.set_sampling(SamplingParams())
        rt.prefill(seq[:40])
        list(rt.decode(0, 12, batch=4))
        rt.truncate(40)
        logits = rt.logits(seq[40:])
        sampling = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=7)
        first = [r.token for r in m.generate(seq[:20], max_tokens=10, sampling=sampling)]
        follow = [r.token for r in m.generate(seq[:20] + first + [40, 41], max_tokens=10, sampling=sampling)]
        got.append((logits, first, follow))
    assert np.array_equal(got[0][0], got[1][0]) and got[0][1:] == got[1][1:]


@pytest.mark.slow
def test_int8_decode_streamed_equals_resident(gpu):
    """The default arithmetic: the fused int8 decode passes (engine/blocks/moe_fused.py), streamed ones reading the
    cache slots the host wrote after the top-k dispatch they add: the resident model's logits, bit for bit."""
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, **KW)
    streamed = load_model(path, gpu=gpu, gpu_weights=budgets(resident, 2), expert_policy="lru", **KW)
    assert streamed.runtime.plan.streaming.slots == 2
    assert "moe_gate_up_q8" in streamed.runtime.dispatched_kernels()
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 256, 24)]
    assert greedy(streamed, prompt, 32) == greedy(resident, prompt, 32)
    assert streamed.runtime.plan.streaming.hit_rate() < 1
    for rt in (streamed.runtime, resident.runtime):  # one row a forward: the decode kernels
        rt.reset()
    assert np.array_equal(streamed.runtime.logits(prompt, chunk=1), resident.runtime.logits(prompt, chunk=1))
    assert_recorded_count(streamed.runtime)  # the segments replayed are the resident token's dispatches
    moe_layers = len(resident.runtime.block("moe").layers)  # + the top-k a layer, read back at the cut
    assert streamed.runtime.dispatches_per_token == resident.runtime.dispatches_per_token + moe_layers


@pytest.mark.slow
def test_budget_below_the_minimum_names_it(gpu):
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, **KW)
    minimum = budgets(resident, 2)  # top-2: two slots a layer
    with pytest.raises(GpuError, match="below this model's minimum") as caught:
        load_model(path, gpu=gpu, gpu_weights=minimum - 1, **KW)
    assert f"{minimum / 2**20:.0f} MiB" in str(caught.value)
    assert load_model(path, gpu=gpu, gpu_weights=minimum, **KW).runtime.plan.streaming.slots == 2


@pytest.mark.slow
def test_dense_model_over_its_budget_is_refused(gpu):
    with pytest.raises(GpuError, match="only mixture-of-experts models"):
        load_model(cached_mlx("dense"), gpu=gpu, gpu_weights=2**16, **KW)


# ---- memfit, `zerotvm models` and the picker ------------------------------------------------------------------


def test_memfit_says_a_moe_model_streams_on_a_small_gpu():
    from engine.catalog import all_models
    from engine.memfit import check_fit
    from engine.sysmem import SystemMemory

    entry = next(e for e in all_models() if e.key == "qwen3.6-35b-a3b-mlx-4bit")
    ram = SystemMemory(64 * 10**9, 48 * 10**9)
    whole = check_fit(entry, 6144, ram, gpu_bytes_available=32 * 2**30)
    assert whole.verdict == "ok" and whole.stream is None
    small = check_fit(entry, 6144, ram, gpu_bytes_available=12 * 2**30)
    st = small.stream
    assert small.verdict == "streams" and 0 < st.slots < 256 and st.tokens_per_s > 0
    assert "runs with experts streamed from RAM, about" in small.message and "tok/s" in small.message
    assert small.ram_needed == whole.ram_needed + st.host_bytes  # the experts kept in RAM count
    assert st.host_bytes == 256 * 40 * st.expert_bytes
    bigger = check_fit(entry, 6144, ram, gpu_bytes_available=16 * 2**30).stream
    assert bigger.slots > st.slots and bigger.tokens_per_s > st.tokens_per_s
    assert check_fit(entry, 6144, ram, gpu_bytes_available=2**30).verdict == "wont_fit"  # below the minimum
    dense = next(e for e in all_models() if e.key == "qwen3-4b-q4f16_1")
    assert check_fit(dense, None, ram, gpu_bytes_available=2**30).stream is None


@pytest.mark.slow
def test_picker_label_and_models_command_say_how_it_streams(monkeypatch, capsys):
    from app.model_list import model_rows
    from engine import memfit
    from engine.cli import main
    from engine.memfit import GpuMemory

    row = next(r for r in model_rows(gpu_bytes=12 * 2**30) if r.entry.key == "qwen3.6-35b-a3b-mlx-q3")
    assert "runs with experts streamed from RAM, about" in row.label and "won't fit" not in row.label
    monkeypatch.setattr(memfit, "gpu_memory", lambda *_: GpuMemory(12 * 2**30, False, "test"))
    assert main(["models"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("qwen3.6-35b-a3b-mlx-4bit"))
    assert "runs with experts streamed from RAM, about" in line


@pytest.mark.slow
def test_cli_says_when_experts_stream_and_the_hit_rate(gpu, capsys, monkeypatch):
    from engine.cli import main

    path = cached_mlx("q4")
    budget = budgets(load_model(path, gpu=gpu, **KW), 4)
    monkeypatch.setenv("ZEROTVM_GPU_WEIGHTS", "1K")  # the flag wins over the environment
    assert main(["logits", str(path), "--ids", "1,2,3,4,5", "--context", "64", "--gpu-weights", str(budget)]) == 0
    err = capsys.readouterr().err
    assert "experts streamed from RAM: 4 of 8 routed experts a layer on the GPU (50% resident)" in err
    assert "expert cache hit rate" in err
    assert main(["logits", str(path), "--ids", "1,2", "--context", "64"]) == 2  # now the environment's 1K
    assert "below this model's minimum" in capsys.readouterr().err


def test_auto_budget_streams_a_moe_model_and_never_refuses():
    from engine.bench_hybrid import hybrid_spec
    from engine.blocks import DeviceTraits
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import RuntimePlan

    spec, formats = hybrid_spec("qwen3.6-35b-a3b-4bit")
    options = RuntimeOptions(max_context=6144)
    assert RuntimePlan(spec, formats, options, DeviceTraits.typical()).streaming is None  # memory unknown: no limit
    small = DeviceTraits(None, 256, True, 32, memory_bytes=12 * 2**30)
    plan = RuntimePlan(spec, formats, options, small)
    assert plan.streaming is not None and plan.memory()["weights"] <= plan.budget < 12 * 2**30
    tiny = DeviceTraits(None, 256, True, 32, memory_bytes=2**30)  # below the minimum: loads whole, the driver decides
    assert RuntimePlan(spec, formats, options, tiny).streaming is None
    with pytest.raises(GpuError, match="minimum"):
        RuntimePlan(spec, formats, RuntimeOptions(max_context=6144, gpu_weights=2**30), small)
    dense, dense_formats = hybrid_spec("qwen3.5-4b")
    assert RuntimePlan(dense, dense_formats, options, tiny).streaming is None  # auto never refuses a dense model
    with pytest.raises(GpuError, match="only mixture-of-experts"):
        RuntimePlan(dense, dense_formats, RuntimeOptions(gpu_weights=2**30), DeviceTraits.typical())
