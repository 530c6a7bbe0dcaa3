"""Routed experts streamed from host memory through a GPU expert cache (engine/blocks/expert_cache.py): a tiny MLX
MoE under a weights budget that forces misses gives the same logits and greedy tokens, bit for bit, as the resident
model (prefill in batches of cached experts, int8 and f32 decode); the slot map's eviction; the budget's errors
and its spelling (--gpu-weights, ZEROTVM_GPU_WEIGHTS)."""

import re
from collections import OrderedDict

import numpy as np
import pytest

from engine.blocks.expert_cache import SlotMap, _runs
from engine.errors import GpuError
from engine.gpu_budget import auto_margin, from_env, parse_size, shown
from engine.model import load_model
from engine.sampling import SamplingParams
from tests.helpers import assert_recorded_count, cached_mlx, run

KW = dict(max_context=320, prefill_chunk=32, split_keys=48)

# ---- the budget's spelling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("123", 123), ("1K", 1024), ("512M", 512 * 2**20), ("12G", 12 * 2**30),
                                         ("1.5G", 3 * 2**29), ("8GiB", 8 * 2**30), ("64 MB", 64 * 2**20),
                                         ("auto", None), ("", None), (None, None), (4096, 4096), ("12g", 12 * 2**30),
                                         ("3.5k", 3584), ("0000012G", 12 * 2**30), ("1024T", 2**50)])
def test_sizes_parse(text, value):
    assert parse_size(text) == value


HOSTILE = ["9" * 400, "9" * 5000 + "K", "1" * 30 + "G", "-5G", "\u0661\u0662G", "nan", "inf", "12 X", "1.5.5G"]


@pytest.mark.parametrize("text", ["12X", "-1G", "0", "G", "1e9", "twelve", "0.0001K", "2000T", -4, 10**30, *HOSTILE])
def test_bad_sizes_are_named(text):
    """Huge digit strings (float() made them inf, then an OverflowError), non-ASCII digits and the rest: one
    sentence naming the option."""
    with pytest.raises(ValueError, match="--gpu-weights") as caught:
        parse_size(text)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


@pytest.mark.parametrize("n, near, up", [(512, "512 bytes", "512 bytes"), (694_656, "678 KiB", "679 KiB"),
                                         (5 * 2**20, "5 MiB", "5 MiB"), (10_600_000_000, "9.87 GiB", "9.88 GiB"),
                                         (2**34 - 1, "16.00 GiB", "16.00 GiB")])
def test_budgets_are_shown_in_the_units_the_flag_takes(n, near, up):
    """A small model's minimum is not "0 MiB"; a minimum is rounded up, so typed back as a budget it is enough."""
    assert (shown(n), shown(n, up=True)) == (near, up)
    value, unit = up.split()
    assert parse_size(f"{value}{unit[0] if unit != 'bytes' else ''}") >= n


def test_environment_budget():
    assert from_env({"ZEROTVM_GPU_WEIGHTS": "10G"}) == 10 * 2**30
    assert from_env({}) is None
    with pytest.raises(ValueError, match="ZEROTVM_GPU_WEIGHTS"):
        from_env({"ZEROTVM_GPU_WEIGHTS": "lots"})


def test_auto_leaves_a_share_of_the_memory_or_a_fixed_margin():
    assert auto_margin(24 * 2**30) == int(24 * 2**30 * 0.05)
    assert auto_margin(8 * 2**30) == 768 * 2**20  # the fixed margin on a small card


def test_cli_refuses_a_bad_budget(capsys):
    from engine.cli import main

    assert main(["logits", "nowhere", "--ids", "1", "--gpu-weights", "12X"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-weights" in err and "12X" in err and "Traceback" not in err


LOADING_COMMANDS = [["logits", "nowhere", "--ids", "1"], ["generate", "nowhere", "--prompt", "hi"], ["chat", "nowhere"],
                    ["bench", "--shape", "tiny-hybrid-moe"]]


@pytest.mark.parametrize("command", LOADING_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("text", ["9" * 400, "-5G", "lots", "2000T"])
@pytest.mark.parametrize("where", ["--gpu-weights", "ZEROTVM_GPU_WEIGHTS"])
def test_every_loading_command_refuses_a_hostile_budget_in_one_sentence(command, text, where, capsys, monkeypatch):
    """The flag or the environment, before the model is even looked for: exit status 2 and one line naming where
    the budget came from, never a traceback (or the missing model's error instead)."""
    from engine.cli import main

    monkeypatch.delenv("ZEROTVM_GPU_WEIGHTS", raising=False)
    if where == "--gpu-weights":
        command = [*command, f"--gpu-weights={text}"]  # "--gpu-weights -5G" is argparse's: -5G looks like a flag
    else:
        monkeypatch.setenv("ZEROTVM_GPU_WEIGHTS", text)
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {where}: ") and "Traceback" not in err[0]


class Loaded(Exception):
    """Raised by the stand-in load_model once it has seen its arguments."""


@pytest.mark.parametrize("command", [["logits", "--ids", "1"], ["generate", "--prompt", "hi"], ["chat"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("flag, env, want", [(["--gpu-weights", "12g"], None, 12 * 2**30),
                                             ([], "8192M", 8 * 2**30), (["--gpu-weights", "1G"], "8G", 2**30),
                                             ([], None, None)])
def test_every_loading_command_passes_context_and_budget_to_the_load(command, flag, env, want, monkeypatch,
                                                                     tmp_path):
    """--context and --gpu-weights (else ZEROTVM_GPU_WEIGHTS; lower-case suffixes too) reach load_model."""
    import engine.model
    from engine import cli

    seen = {}

    def load_model(path, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(engine.model, "load_model", load_model)
    monkeypatch.setattr(cli, "_chosen_adapter", lambda: None)
    monkeypatch.delenv("ZEROTVM_GPU_WEIGHTS", raising=False)
    if env:
        monkeypatch.setenv("ZEROTVM_GPU_WEIGHTS", env)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(Loaded):
        cli.main([command[0], str(tmp_path / "m.gguf"), *command[1:], "--context", "96", *flag])
    assert (seen["max_context"], seen["gpu_weights"]) == (96, want)


def test_budget_errors_get_their_own_dialog_not_the_gpu_drivers():
    """The app's dialog for a budget below the minimum, a dense model over it, or a bad ZEROTVM_GPU_WEIGHTS: the
    engine's sentence and where to change it, not "No compatible GPU ... update the graphics driver"."""
    pytest.importorskip("PySide6")
    from app.errors import describe_error
    from engine.bench_hybrid import hybrid_spec
    from engine.blocks import DeviceTraits
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import RuntimePlan

    errors = []
    for shape in ("qwen3.6-35b-a3b-4bit", "qwen3.5-4b"):
        spec, formats = hybrid_spec(shape)
        with pytest.raises(GpuError) as caught:
            RuntimePlan(spec, formats, RuntimeOptions(max_context=6144, gpu_weights=2**30), DeviceTraits.typical())
        errors.append(caught.value)
    with pytest.raises(ValueError) as caught:
        from_env({"ZEROTVM_GPU_WEIGHTS": "9" * 400})
    errors.append(caught.value)
    for e, says in zip(errors, ("minimum of", "only mixture-of-experts", "ZEROTVM_GPU_WEIGHTS"), strict=True):
        title, message = describe_error(e, what="load the model")
        assert title == "GPU weights budget" and says in message and "Settings → GPU weights budget" in message
        assert "graphics driver" not in message and "Unexpected" not in title


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


class ScanSlotMap:
    """The policy as first written: LFU scans every slot for its victim (SlotMap keeps a heap instead)."""

    def __init__(self, experts, slots, policy):
        self.policy, self.slots, self.where = policy, slots, OrderedDict()
        self.uses, self.free, self.requests = np.zeros(experts, np.int64), list(range(slots - 1, -1, -1)), 0

    def assign(self, wanted):
        wanted, out, loads = list(dict.fromkeys(wanted)), {}, []
        self.requests += 1
        if self.requests % SlotMap.HALF_LIFE == 0:
            self.uses //= 2
        for e in wanted:
            self.uses[e] += 1
            if e in self.where:
                self.where.move_to_end(e)
                out[e] = self.where[e]
        for e in wanted:
            if e not in out:
                if self.free:
                    slot = self.free.pop()
                else:
                    free = [x for x in self.where if x not in wanted]
                    victim = free[0] if self.policy == "lru" else min(free, key=lambda x: self.uses[x])
                    slot = self.where.pop(victim)
                self.where[e] = out[e] = slot
                loads.append((e, slot))
        return out, loads


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("experts, slots, k, spread", [(256, 101, 8, 0.0), (256, 223, 8, 1.5), (8, 3, 2, 0.0),
                                                        (64, 16, 8, 1.0)])
def test_slot_map_evicts_as_a_scan_of_every_slot_would(policy, experts, slots, k, spread):
    """Skewed and uniform requests over several halvings of the LFU counts, some with repeated experts: the same
    slots, loads and recency order as the scan."""
    rng = np.random.default_rng(experts + slots)
    p = np.exp(spread * rng.standard_normal(experts))
    fast, scan = SlotMap(experts, slots, policy), ScanSlotMap(experts, slots, policy)
    for t in range(3 * SlotMap.HALF_LIFE + 50):
        wanted = rng.choice(experts, k, replace=False, p=p / p.sum()).tolist()
        wanted += wanted[:2] if t % 7 == 0 else []
        assert fast.assign(wanted) == scan.assign(wanted)
        assert list(fast.where.items()) == list(scan.where.items())
    assert fast.misses > slots  # it evicted


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


def test_gather_on_threads_splits_the_bytes_evenly(monkeypatch):
    """Plain stacks and a lazy row join gathered on three threads: every byte where _gather puts it, each thread's
    share the same size (the caller's, last, what is left)."""
    from engine.blocks import expert_cache
    from engine.formats.mlx_layout import RowJoin

    monkeypatch.setattr(expert_cache, "MIN_THREAD_BYTES", 1)
    monkeypatch.setattr(expert_cache, "GATHER_THREADS", 3)
    shares = []
    copy_all = expert_cache._copy_all
    monkeypatch.setattr(expert_cache, "_copy_all", lambda pairs: (shares.append(sum(d.size for _, d in pairs)),
                                                                  copy_all(pairs)))
    rng = np.random.default_rng(1)
    joined = RowJoin([rng.integers(0, 2**32, (9, n, 4), dtype=np.uint32) for n in (3, 2)])
    stacks = [rng.integers(0, 2**32, (9, 5, 4), dtype=np.uint32), rng.standard_normal((9, 7)).astype(np.float16),
              joined]
    ids = np.array([8, 0, 3, 4, 7, 2, 1])
    outs = [np.zeros(len(ids) * (a.nbytes // 9), np.uint8) for a in stacks]
    expert_cache._gather_all([(a, ids, o) for a, o in zip(stacks, outs, strict=True)])
    for a, o in zip(stacks, outs, strict=True):
        assert o.tobytes() == expert_cache._gather(a, ids).tobytes()
    total = sum(o.size for o in outs)
    assert len(shares) == 3 and shares[0] == shares[1] == -(-total // 3) and sum(shares) == total


@pytest.mark.parametrize("top_k, slots", [(8, 9), (2, 2)])
def test_slot_lookup_reads_the_layer_table(gpu, top_k, slots):
    """shaders/expert_slots.wgsl through a table at an offset (a layer's range): routed slots get their expert's
    table entry, an id past the experts (NaN logits) the last expert's, the shared slot its fixed slot."""
    from engine.kernels.expert_cache import EXPERT_SLOTS, slots_plan

    E, shared_slot = 64, 40
    rng = np.random.default_rng(top_k)
    tables = rng.permutation(2 * 64).astype(np.uint32).reshape(2, 64)  # layer 1's table follows layer 0's
    ids = np.append(rng.choice(E, top_k - 1, replace=False), E + 5).astype(np.uint32)
    ids = np.append(ids, [E] * (slots - top_k)).astype(np.uint32)
    table_buf, ids_buf = gpu.upload("table", tables), gpu.upload("ids", ids)
    out = gpu.buffer("slot_ids", 4 * slots)
    gpu.write(out, np.full(slots, 999, np.uint32))
    consts, grid = slots_plan(E, top_k, slots, shared_slot)
    run(gpu, EXPERT_SLOTS, consts, dict(ids=ids_buf, table=(table_buf, 256, 256), slot_ids=out), grid)
    want = np.append(tables[1][np.minimum(ids[:top_k], E - 1)], [shared_slot] * (slots - top_k))
    assert np.array_equal(gpu.read(out, np.uint32, slots), want)


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


@pytest.mark.slow
def test_int8_prefill_streamed_equals_resident(gpu):
    """int8 prefill (the real Qwen3.6's default): the grouped passes of each batch of cached experts, the gate_ups
    writing the downs' int8 rows (q8_epilogues), give the resident model's logits bit for bit."""
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, q8_prefill=True, **KW)
    streamed = load_model(path, gpu=gpu, q8_prefill=True, gpu_weights=budgets(resident, 3), **KW)
    moe = streamed.runtime.block("moe")
    assert all(moe.grouped[i]["rows_q8"] for i in moe.layers)
    assert "quantize_q8" not in [pipe.label for pipe, *_ in moe.passes[moe.layers[0]]["grouped_batch"]]
    ids = np.random.default_rng(6).integers(0, resident.runtime.spec.vocab, 70)
    before = streamed.runtime.plan.streaming.misses
    assert np.array_equal(streamed.logits(ids), resident.logits(ids))
    assert streamed.runtime.plan.streaming.misses - before > 8 * 4  # batches: evicted and refilled


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
    moe = streamed.runtime.block("moe")  # + a layer's top-k, read back at the cut, and its slot lookup
    assert streamed.runtime.dispatches_per_token == resident.runtime.dispatches_per_token + 2 * len(moe.layers)


def table_of(model) -> dict[int, np.ndarray]:
    """Each MoE layer's expert -> slot table as the GPU holds it."""
    moe = model.runtime.block("moe")
    st = moe.stream
    words = model.runtime.gpu.read(moe.slot_table, np.uint32).reshape(len(st.layers), -1)
    return {i: words[st.table_index[i], :st.E] for i in st.layers}


@pytest.fixture(scope="module")
def roomy(gpu):
    """(resident, streamed with 7 of 8 experts a layer), default arithmetic."""
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, **KW)
    return resident, load_model(path, gpu=gpu, gpu_weights=budgets(resident, 7), **KW)


@pytest.mark.slow
def test_the_gpu_slot_tables_follow_the_slot_maps(pair):
    """After prefills in batches and decode tokens that evict and refill, every layer's table on the GPU says where
    each expert is, as the host's SlotMap does (the slots' count for absent experts)."""
    resident, streamed = pair
    greedy(streamed, [int(t) for t in np.random.default_rng(5).integers(0, 256, 40)], 12)
    st = streamed.runtime.plan.streaming
    assert st.misses > st.slots * len(st.layers)
    for i, table in table_of(streamed).items():
        want = np.full(st.E, st.slots, np.uint32)
        for e, slot in st.maps[i].where.items():
            want[e] = slot
        assert np.array_equal(table, want) and np.array_equal(st.slot_of[i], want)


@pytest.mark.slow
def test_a_token_whose_experts_are_cached_writes_nothing_to_the_moe_buffers(roomy, monkeypatch):
    """A token and one decode step run twice from the same state: the second time every layer finds its experts
    cached, so the host uploads nothing and writes none of the MoE block's buffers (the slots come from the GPU's
    tables), and both runs' logits are the resident model's."""
    resident, streamed = roomy
    rt, st = streamed.runtime, streamed.runtime.plan.streaming

    def one_step(model):
        model.runtime.reset()
        model.runtime.set_sampling(SamplingParams())
        first = model.runtime.logits([7])  # one token: the decode kernels, its routing read back as it records
        model.runtime.reset()
        model.runtime.prefill([7])
        return first, [t for b in model.runtime.decode(0, 1) for t in b]  # a captured decode step, in segments

    want = one_step(resident)
    got = one_step(streamed)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    written = []
    write = rt.gpu.write
    monkeypatch.setattr(rt.gpu, "write", lambda buf, *a, **k: (written.append(buf.label), write(buf, *a, **k)))
    hits, misses, uploaded = st.hits, st.misses, st.uploaded_bytes
    again = one_step(streamed)
    assert np.array_equal(again[0], want[0]) and again[1] == want[1]
    assert st.misses == misses and st.uploaded_bytes == uploaded
    assert st.hits - hits == 3 * 2 * len(st.layers)  # three forwards of top-2 each
    assert written and not [label for label in written if label.startswith("moe.")]


@pytest.mark.slow
def test_misses_between_cached_layers_of_a_token_are_exact(roomy):
    """Greedy decode with 7 of 8 experts a layer cached: tokens where one layer misses while the layers before it
    in the same token found every expert; the tokens are the resident model's."""
    resident, streamed = roomy
    moe = streamed.runtime.block("moe")
    events = []  # (layer, experts loaded) per streamed layer, in order
    upload = moe.stream.upload
    moe.stream.upload = lambda layer, cache, loads: (events.append((layer, len(loads))), upload(layer, cache, loads))
    resolve = moe.resolve
    moe.resolve = lambda rec, layer: (events.append((layer, 0)), resolve(rec, layer))
    try:
        prompt = [int(t) for t in np.random.default_rng(6).integers(0, 256, 30)]
        assert greedy(streamed, prompt, 40) == greedy(resident, prompt, 40)
    finally:
        del moe.stream.upload, moe.resolve
    first = moe.layers[0]
    tokens, token = [], None
    for layer, loads in events:  # a resolve's (layer, 0), then its upload's (layer, n) when it missed
        if loads == 0 and layer == first:
            token = {}
            tokens.append(token)
        if token is not None:
            token[layer] = token.get(layer, 0) + loads
    mixed = [t for t in tokens if any(t[a] == 0 and t[b] > 0 for a in t for b in t if a < b)]
    assert len(tokens) == 40 and mixed  # the prompt's last token (alone) and 39 decode steps


@pytest.mark.slow
def test_a_token_stopped_half_way_leaves_the_cache_exact(pair, monkeypatch):
    """An error after a layer's uploads were handed to the token's recorder, which is then dropped unsubmitted:
    the cache forgets what it held, and later tokens are still the resident model's."""
    resident, streamed = pair
    moe, st = streamed.runtime.block("moe"), streamed.runtime.plan.streaming
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 256, 20)]
    want = greedy(resident, prompt, 16)
    resolve, calls = moe.resolve, []

    def failing(rec, layer):
        resolve(rec, layer)
        calls.append(layer)
        if len(calls) == 6:
            assert rec._first  # uploads waiting for this recorder's submit
            raise RuntimeError("stopped")

    monkeypatch.setattr(moe, "resolve", failing)
    with pytest.raises(RuntimeError, match="stopped"):
        greedy(streamed, prompt, 16)
    monkeypatch.setattr(moe, "resolve", resolve)
    assert all(not m.where for m in st.maps.values())
    assert greedy(streamed, prompt, 16) == want
    assert all(np.array_equal(t, st.slot_of[i]) for i, t in table_of(streamed).items())


@pytest.mark.slow
def test_polled_mappings_give_the_resident_models_logits_and_tokens(gpu, monkeypatch):
    """The routing readbacks and staging buffers waited for by polling on the calling thread (expert_cache.MAP_WAIT
    "polled", engine/mapping.py): prefill in batches of cached experts, greedy decode in segments, and a token
    stopped half-way give the resident model's logits and tokens, bit for bit."""
    from engine.blocks import expert_cache
    from engine.mapping import PolledMap

    monkeypatch.setattr(expert_cache, "MAP_WAIT", "polled")
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, **KW)
    streamed = load_model(path, gpu=gpu, gpu_weights=budgets(resident, 3), **KW)
    moe, st = streamed.runtime.block("moe"), streamed.runtime.plan.streaming
    assert all(isinstance(m, PolledMap) for m in [*st.readback_maps.values(), *st.staging_maps])
    ids = np.random.default_rng(8).integers(0, resident.runtime.spec.vocab, 70)
    before = st.misses
    assert np.array_equal(streamed.logits(ids), resident.logits(ids))
    assert st.misses - before > 8 * 4  # batches: evicted and refilled
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 256, 30)]
    want = greedy(resident, prompt, 24)
    assert greedy(streamed, prompt, 24) == want
    resolve, calls = moe.resolve, []

    def failing(rec, layer):
        resolve(rec, layer)
        calls.append(layer)
        if len(calls) == 7:
            raise RuntimeError("stopped")

    monkeypatch.setattr(moe, "resolve", failing)
    with pytest.raises(RuntimeError, match="stopped"):
        greedy(streamed, prompt, 24)
    monkeypatch.setattr(moe, "resolve", resolve)
    assert greedy(streamed, prompt, 24) == want


@pytest.mark.slow
def test_budget_below_the_minimum_names_it(gpu):
    path = cached_mlx("q4")
    resident = load_model(path, gpu=gpu, **KW)
    minimum = budgets(resident, 2)  # top-2: two slots a layer
    with pytest.raises(GpuError, match="below this model's minimum") as caught:
        load_model(path, gpu=gpu, gpu_weights=minimum - 1, **KW)
    # The minimum as the flag takes it, rounded up: typed back, it loads (it once said "0 MiB" for this model).
    figure = re.search(r"minimum of ([0-9.]+) (KiB|MiB|GiB)", str(caught.value))
    assert figure and figure[0] == f"minimum of {shown(minimum, up=True)}"
    assert parse_size(f"{figure[1]}{figure[2][0]}") >= minimum
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


def test_streaming_on_tight_ram_is_said_and_asked_about():
    """RAM that the host-resident experts leave nearly full: the verdict stays "streams" (the GPU's story), but the
    message says so and the app asks before loading, as for any tight model, also for a MoE model without the
    catalog's own RAM warning (one added from disk)."""
    from dataclasses import replace

    from engine.catalog import all_models
    from engine.memfit import TIGHT_MARGIN, check_fit
    from engine.sysmem import SystemMemory

    entry = next(e for e in all_models() if e.key == "qwen3.6-35b-a3b-mlx-4bit")
    entry = replace(entry, ram_warning_bytes=None, ram_warning=None)
    roomy = check_fit(entry, 6144, SystemMemory(256 * 10**9, 200 * 10**9), gpu_bytes_available=12 * 2**30)
    assert roomy.verdict == "streams" and not roomy.load_anyway and "close other apps" not in roomy.message
    just = int(roomy.ram_needed / (1 - TIGHT_MARGIN / 2))  # above the need, inside the tight margin
    tight = check_fit(entry, 6144, SystemMemory(256 * 10**9, just), gpu_bytes_available=12 * 2**30)
    assert tight.verdict == "streams" and tight.ram_needed == roomy.ram_needed < just
    assert tight.load_anyway and "Its experts in RAM leave little of it free: close other apps first." in tight.message


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
    err = capsys.readouterr().err.splitlines()
    minimum = budgets(load_model(path, gpu=gpu, **KW), 2)
    assert err[-1].startswith("error: the weights budget of 1 KiB is below this model's minimum of ")
    assert f"minimum of {shown(minimum, up=True)} " in err[-1] and "Traceback" not in "".join(err)
    # A dense model over its budget: one line saying only MoE models stream, never a silent failure.
    assert main(["logits", str(cached_mlx("dense")), "--ids", "1,2", "--gpu-weights", "64K"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: this model's weights need ") and "only mixture-of-experts" in err[-1]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_say_when_experts_stream_and_the_hit_rate_at_the_end(gpu, capsys, monkeypatch, command):
    """The same stderr lines as logits: the share resident after the load (before the reply), the hit rate at the
    end (chat: when it is left)."""
    import builtins

    from engine.cli import main

    path = cached_mlx("q4")
    budget = budgets(load_model(path, gpu=gpu, **KW), 4)
    typed = iter(["hi"])

    def answer(prompt=""):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", answer)
    args = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(path), *args, "--max-tokens", "3", "--temperature", "0", "--context", "64",
                 "--gpu-weights", str(budget)]) == 0
    err = capsys.readouterr().err
    share = err.index("experts streamed from RAM: 4 of 8 routed experts a layer on the GPU (50% resident)")
    rate = err.index("expert cache hit rate")
    assert share < err.index(" tokens, ") < rate  # the reply's stats line between them
    assert err.count("expert cache hit rate") == 1 and err.rstrip().splitlines()[-1].startswith("expert cache hit")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["logits", "--ids", "1,2"], ["generate", "--prompt", "hi"]], ids=lambda c: c[0])
def test_ctrl_c_during_the_load_stops_it_in_one_line(capsys, monkeypatch, command):
    """Ctrl-C while a checkpoint is read: exit status 130, the progress line (naming the shard) ended by one line,
    no traceback."""
    from engine import cli

    shown = []

    def progress(part, parts, path, done, total):
        shown.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_progress", progress)
    path = cached_mlx("q4")
    assert cli.main([command[0], str(path), *command[1:]]) == 130
    err = capsys.readouterr().err
    assert shown[0].endswith("model.safetensors") and err.endswith("\n(loading stopped)\n")
    assert "Traceback" not in err


def test_the_load_progress_line_names_the_shard_being_read(capsys):
    from engine.cli import _progress

    _progress(0, 2, "/m/model-00001-of-00002.safetensors", 3 * 2**20, 8 * 2**20)
    _progress(1, 2, "/m/model-00002-of-00002.safetensors", 8 * 2**20, 8 * 2**20)
    err = capsys.readouterr().err
    assert "loading model-00001-of-00002.safetensors:     3.0/8.0 MiB ( 38%)" in err
    assert "loading model-00002-of-00002.safetensors" in err and err.endswith("\n")


@pytest.mark.slow
def test_bench_under_a_budget_reports_the_stream(gpu, capsys, monkeypatch):
    """`zerotvm bench --gpu-weights` on a MoE shape: the result carries the share resident and the hit rate, and
    the command prints both on stderr as generate, chat and logits do."""
    import engine.bench
    from bench.expert_stream import budget_bytes
    from engine.bench import run_bench
    from engine.bench_hybrid import hybrid_spec
    from engine.cli import main

    budget = budget_bytes("slots:3", *hybrid_spec("tiny-hybrid-moe"))
    r = run_bench("tiny-hybrid-moe", decode_tokens=4, prompt_tokens=24, runs=1, gpu=gpu, long_prompt=0,
                  gpu_weights=budget)
    assert r["expert_stream"] == "experts streamed from RAM: 3 of 8 routed experts a layer on the GPU (38% resident)"
    assert r["expert_cache"].startswith("expert cache hit rate") and r["expert_cache"] in r["table"]
    assert "expert_stream" not in run_bench("tiny-hybrid-moe", decode_tokens=4, prompt_tokens=24, runs=1, gpu=gpu,
                                            long_prompt=0)
    monkeypatch.setattr(engine.bench, "run_bench", lambda *a, **k: r)
    assert main(["bench", "--shape", "tiny-hybrid-moe", "--gpu-weights", str(budget)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [r["expert_stream"], r["expert_cache"]]


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


@pytest.mark.slow
def test_the_stream_benchmark_runs_on_a_tiny_shape(tmp_path):
    """bench/expert_stream.py end to end on the tiny hybrid MoE (3 of 8 experts cached): each routing's decode and
    prefill, the hit rate, and the breakdown's phases, which are parts of the token's wall time."""
    import json

    from bench import expert_stream

    out = tmp_path / "stream.json"
    assert expert_stream.main(["--json", str(out), "--shapes", "tiny-hybrid-moe", "--budgets", "slots:3",
                               "--tokens", "4", "--warmup", "2", "--prefill", "20", "--breakdown"]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["routing"] for r in rows] == ["random", "skewed"] and all(r["slots"] == 3 for r in rows)
    for r in rows:
        ms = r["host_ms_per_token"]
        assert 0 < r["hit_rate"] < 1 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert ms["ids_wait"] > 0 and ms["policy"] > 0 and ms["route"] > 0 and ms["slot_write"] == 0
        assert sum(v for k, v in ms.items() if k not in ("other", "wall")) <= ms["wall"]


# ---- auto counts wgpu's allocator blocks (engine/gpu_heap.py), in the runtime's plan and in memfit alike ----------
GIB = 2**30


def moe_35b(memory_bytes=None, gpu_weights=None):
    from engine.bench_hybrid import hybrid_spec
    from engine.blocks import DeviceTraits
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import RuntimePlan

    spec, formats = hybrid_spec("qwen3.6-35b-a3b-4bit")
    traits = DeviceTraits(None, 256, True, 32, memory_bytes=memory_bytes)
    return RuntimePlan(spec, formats, RuntimeOptions(max_context=6144, gpu_weights=gpu_weights), traits)


@pytest.mark.parametrize("memory", [8 * GIB, 12 * GIB, 16 * GIB])
def test_auto_slots_are_the_most_whose_blocks_fit_and_memfit_agrees(memory):
    from engine.memfit_stream import stream_fit
    from engine.transformer import expert_weight_bytes, moe_block

    plan = moe_35b(memory)
    room = memory - auto_margin(memory)
    st = plan.streaming
    assert st is not None and plan.footprint().peak <= room  # the load's blocks, not only its buffers, fit
    _, fixed, per_slot = expert_weight_bytes(moe_35b(), moe_block(moe_35b()))
    assert plan.budget == fixed + st.slots * per_slot == plan.memory()["weights"]
    one_more = moe_35b(memory, plan.budget + per_slot)
    assert one_more.streaming.slots == st.slots + 1 and one_more.footprint().peak > room
    fit = stream_fit(moe_35b(), memory)  # memfit's verdict asks the same rule
    assert (fit.slots, fit.budget) == (st.slots, plan.budget)


def test_auto_streams_where_the_buffers_fit_but_their_blocks_do_not():
    from engine.memfit_stream import stream_fit
    from engine.transformer import expert_weight_bytes, moe_block

    # The whole model: its buffers and the margin fit 20 GiB (the raw count kept every expert), its blocks do not
    # (the last block's tail and the upload staging: its paired down stacks waste none, engine/blocks/moe_pairs.py).
    whole, memory = moe_35b(), 20 * GIB
    assert sum(whole.memory().values()) + auto_margin(memory) <= memory < whole.footprint().peak + auto_margin(memory)
    assert moe_35b(memory).streaming is not None and stream_fit(whole, memory) is not None
    assert moe_35b(21 * GIB).streaming is None and stream_fit(whole, 21 * GIB) is None  # 21 GiB holds the blocks
    # 172 slots: a gate/up stack (173 MiB) and a down stack (86 MiB) no longer share a 256 MiB block, so each takes
    # one of its own; at 14.5 GiB auto stops below that, where the buffers alone would say 172 fit.
    _, fixed, per_slot = expert_weight_bytes(whole, moe_block(whole))
    streamed, memory = moe_35b(None, fixed + 172 * per_slot), 29 * GIB // 2
    assert streamed.streaming.slots == 172
    assert sum(streamed.memory().values()) + auto_margin(memory) <= memory
    assert streamed.footprint().peak + auto_margin(memory) > memory
    assert moe_35b(memory).streaming.slots < 172


def test_memfit_says_it_streams_wherever_the_runtimes_auto_would():
    from engine.blocks import DeviceTraits
    from engine.catalog import all_models
    from engine.memfit import check_fit, entry_spec
    from engine.memfit_stream import entry_formats
    from engine.runtime_options import RuntimeOptions
    from engine.sysmem import SystemMemory
    from engine.transformer import RuntimePlan

    entry = next(e for e in all_models() if e.key == "qwen3.6-35b-a3b-mlx-4bit")
    ram = SystemMemory(64 * 10**9, 48 * 10**9)
    spec = entry_spec(entry)
    for memory in (12 * GIB, 20 * GIB, 22 * GIB, 32 * GIB):
        fit = check_fit(entry, 6144, ram, gpu_bytes_available=memory)
        plan = RuntimePlan(spec, entry_formats(entry, spec), RuntimeOptions(max_context=6144),
                           DeviceTraits(None, 256, True, 32, memory_bytes=memory))
        st = plan.streaming
        assert (fit.verdict == "streams") == (st is not None) and (fit.stream and fit.stream.slots) == (st and st.slots)
    # 20 GiB holds the model's buffers (memfit once said "tight" and loaded it whole) but not its blocks and the margin
    fit = check_fit(entry, 6144, ram, gpu_bytes_available=20 * GIB)
    assert fit.gpu_needed <= 20 * GIB and fit.verdict == "streams"


def _budget_plan(entry, budget, context=6144):
    """The runtime's own plan of a catalog entry under an explicit weights budget (what a load with it builds)."""
    from engine.memfit import entry_spec
    from engine.memfit_stream import entry_formats
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import RuntimePlan

    spec = entry_spec(entry)
    return RuntimePlan(spec, entry_formats(entry, spec), RuntimeOptions(max_context=context, gpu_weights=budget))


def test_memfit_takes_a_budget_set_by_hand_as_the_load_does():
    """An explicit budget (Settings, --gpu-weights, ZEROTVM_GPU_WEIGHTS) decides the verdict as the load will take
    it, whatever auto would do on that GPU: a MoE model over it streams with the slots the runtime gives it and
    needs that plan's GPU memory; below its minimum, or a dense model over it, cannot load, in the load's words."""
    from engine.catalog import all_models
    from engine.errors import WeightsBudgetError
    from engine.memfit import check_fit, fit_is_quick
    from engine.sysmem import SystemMemory

    entry = next(e for e in all_models() if e.key == "qwen3.6-35b-a3b-mlx-4bit")
    ram = SystemMemory(128 * 10**9, 100 * 10**9)
    whole = check_fit(entry, 6144, ram, gpu_bytes_available=24 * GIB)
    assert whole.verdict == "ok" and whole.stream is None  # auto keeps it whole on 24 GiB
    fit = check_fit(entry, 6144, ram, gpu_bytes_available=24 * GIB, gpu_weights=8 * GIB)
    plan = _budget_plan(entry, 8 * GIB)
    assert fit.verdict == "streams" and fit.stream.slots == plan.streaming.slots and fit.stream.budget == 8 * GIB
    assert fit.gpu_needed == plan.footprint().steady < whole.gpu_needed  # the streamed plan's blocks, not the model's
    assert fit.estimate.weights_bytes == plan.memory()["weights"]
    assert fit.ram_needed == whole.ram_needed + fit.stream.host_bytes
    assert fit.summary.startswith("runs with experts streamed from RAM, about ")
    assert "The GPU weights budget of 8.00 GiB does not hold it whole." in fit.message
    assert fit_is_quick(entry, 6144, 24 * GIB, 8 * GIB)  # remembered: the picker does not plan it again
    assert not fit_is_quick(entry, 6144, 24 * GIB, 9 * GIB)
    # Below the minimum: the sentence the load raises, and no "Load anyway" that could work.
    with pytest.raises(WeightsBudgetError) as refused:
        _budget_plan(entry, GIB)
    low = check_fit(entry, 6144, ram, gpu_bytes_available=24 * GIB, gpu_weights=GIB)
    assert low.verdict == "wont_fit" and low.stream is None and str(refused.value) in low.message
    assert low.summary == "does not fit the weights budget (1.00 GiB)" and "minimum of 1.83 GiB" in low.message
    # A budget over the weights loads it whole, so a GPU too small for it does not fit (auto would have streamed).
    big = check_fit(entry, 6144, ram, gpu_bytes_available=12 * GIB, gpu_weights=64 * GIB)
    assert check_fit(entry, 6144, ram, gpu_bytes_available=12 * GIB).verdict == "streams"
    assert big.verdict == "wont_fit" and big.stream is None and big.gpu_needed == whole.gpu_needed
    assert "With the GPU weights budget of 64.00 GiB it needs 20.5 GB of GPU memory: lower the budget, or set it " \
           "to auto." in big.message
    # A streamed plan still too big for the GPU: the same advice.
    over = check_fit(entry, 6144, ram, gpu_bytes_available=12 * GIB, gpu_weights=16 * GIB)
    assert over.verdict == "wont_fit" and over.stream is not None and over.gpu_needed > 12 * GIB
    assert "lower the budget, or set it to auto" in over.message
    dense = next(e for e in all_models() if e.key == "qwen3-4b-q4f16_1")
    with pytest.raises(WeightsBudgetError) as dense_refused:
        _budget_plan(dense, GIB, 4096)
    small = check_fit(dense, 4096, ram, gpu_bytes_available=24 * GIB, gpu_weights=GIB)
    assert small.verdict == "wont_fit" and str(dense_refused.value) in small.message
    assert small.summary == "does not fit the weights budget (1.00 GiB)"
    roomy = check_fit(dense, 4096, ram, gpu_bytes_available=24 * GIB, gpu_weights=16 * GIB)
    assert roomy.verdict == "ok" and roomy.summary == check_fit(dense, 4096, ram, gpu_bytes_available=24 * GIB).summary


def test_a_dense_refusal_never_rounds_the_weights_down_to_the_budget():
    """Phi-3's 2.0x GiB of weights under a 2 GiB budget: the sentence once read "need 2.00 GiB ... budget is
    2.00 GiB"; the need is rounded up, as a minimum is."""
    from engine.catalog import all_models
    from engine.errors import WeightsBudgetError

    phi3 = next(e for e in all_models() if e.key == "phi3-mini-4k-q4f16_1")
    with pytest.raises(WeightsBudgetError) as refused:
        _budget_plan(phi3, 2 * GIB, 4096)
    assert "weights need 2.01 GiB on the GPU but the weights budget is 2.00 GiB" in str(refused.value)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_models_command_judges_with_the_budget_set(how, monkeypatch, capsys):
    """`zerotvm models --gpu-weights 2G` (or ZEROTVM_GPU_WEIGHTS=2G) on a 24 GiB GPU: the MoE model that auto keeps
    whole says it streams, and a dense one over the budget says it cannot load; a misspelt budget is one line."""
    from engine import memfit
    from engine.cli import main
    from engine.memfit import GpuMemory

    monkeypatch.setattr(memfit, "gpu_memory", lambda *_: GpuMemory(24 * GIB, False, "test"))
    monkeypatch.setattr(memfit, "system_memory", lambda: memfit.SystemMemory(256 * 10**9, 200 * 10**9))  # not ours
    monkeypatch.delenv("ZEROTVM_GPU_WEIGHTS", raising=False)

    def lines(*extra):
        assert main(["models", *extra]) == 0
        out = capsys.readouterr().out.splitlines()
        return {ln.split()[0]: ln for ln in out if ln and not ln.startswith(" ")}

    auto = lines()
    assert "fits (" in auto["qwen3.6-35b-a3b-mlx-4bit"] and "fits (" in auto["qwen3-4b-q4f16_1"]
    if how == "flag":
        budget = lines("--gpu-weights", "2G")
    else:
        monkeypatch.setenv("ZEROTVM_GPU_WEIGHTS", "2G")
        budget = lines()
    assert "runs with experts streamed from RAM, about" in budget["qwen3.6-35b-a3b-mlx-4bit"]
    assert budget["qwen3-4b-q4f16_1"].endswith("does not fit the weights budget (2.00 GiB)")
    assert "fits (" in budget["smollm2-135m-demo"]
    if how == "flag":
        assert main(["models", "--gpu-weights", "lots"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --gpu-weights: 'lots' is not a size")
