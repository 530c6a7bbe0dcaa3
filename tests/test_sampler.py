"""GPU sampling (sample_penalty.wgsl + sample.wgsl through GpuSampler) against the float64 reference.

Each distribution test draws 20,000 tokens in one dispatch (one workgroup per draw) and compares the
frequencies with reference_probs by a chi-square test; tokens outside the kept set must never appear.
"""

import json
import math

import numpy as np
import pytest

from engine.blocks.sampler import GpuSampler
from engine.errors import ModelFormatError
from engine.gpu import Recorder
from engine.sampling import NO_TOKEN, WINDOW, SamplingParams, reference_probs
from tests.helpers import poisoned, read, run, step_uniform

DRAWS = 20_000
BIG_V = 151_936
POISON = np.iinfo(np.uint32).max


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    a, x = df / 2, stat / 2
    if x <= 0:
        return 1.0
    scale = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:  # series for the lower part
        term = total = 1 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1 - total * scale)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)  # Lentz's continued fraction for the upper part
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = 1 / (an * d + b or 1e-300)
        c = b + an / c or 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h * scale


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; bins expecting < 5 draws are pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    rest = (probs > 0) & ~big
    if rest.any():
        obs.append(counts[rest].sum())
        exp.append(expected[rest].sum())
    obs, exp = np.array(obs, float), np.array(exp)
    if len(obs) < 2:
        return 1.0
    return chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)


def sample(gpu, logits, params, draws, history=(), wg=16, cap=512, out_index=3):
    """Penalty + `draws` samples of one logits row; history[-1] is this forward's input id."""
    vocab = len(logits)
    ids = np.asarray(history, np.uint32)
    fed = np.full(4, POISON, np.uint32)
    if len(ids):
        fed[0] = ids[-1]
    tokens = gpu.upload("tokens", fed)
    ring = poisoned(gpu, "ring", (out_index + draws + 2,), np.uint32)
    step = step_uniform(gpu, n_tokens=1, pos0=max(len(ids) - 1, 0), out_index=out_index)
    sampler = GpuSampler(gpu, vocab, gpu.upload("logits", np.asarray(logits, np.float32)), tokens, ring, step,
                         wg=wg, cap=cap)
    sampler.set_params(params)
    sampler.set_history(ids[:-1])
    rec = Recorder(gpu, "sample")
    sampler.record(rec, draws)
    rec.submit()
    out = read(gpu, ring, (out_index + draws + 2,), np.uint32)
    assert np.all(out[:out_index] == POISON) and np.all(out[out_index + draws:] == POISON)
    got = out[out_index:out_index + draws]
    assert read(gpu, tokens, (4,), np.uint32)[0] == got[0]
    return got


def check_distribution(got, probs):
    counts = np.bincount(got, minlength=len(probs))
    assert len(counts) == len(probs), "sampled an id outside the vocabulary"
    outside = np.flatnonzero((counts > 0) & (probs == 0))
    assert len(outside) == 0, f"drew filtered-out tokens {outside.tolist()}"
    p = chi2_pvalue(counts, probs)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


@pytest.fixture(scope="module")
def logits64():
    x = np.random.default_rng(1234).standard_normal(64).astype(np.float32) * 1.2
    x[[5, 40]] = x.max() + 0.1  # a tie at the top
    return x


def test_chi2_sf_matches_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.342, 100) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(10.0, 20) == pytest.approx(0.968172, rel=1e-5)


HISTORY = [3, 9, 9, 70, 17, 5, 22, 9, 63, 1 << 20]  # repeats and an out-of-vocab id

CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=10),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.3, min_p=0.05),
    "combined": dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.02),
    "top_k_min_p": dict(temperature=1.0, top_k=50, min_p=0.1),
    "penalty": dict(temperature=1.0, top_k=30, repetition_penalty=1.8, penalty_window=6),
}


# cap 1 forces the bisection fallback (the top tie never fits); without top-k/top-p it is one pass anyway.
@pytest.mark.parametrize("case,cap", [(c, 512) for c in CASES] + [("top_p", 1), ("combined", 1)])
def test_frequencies_match_reference(gpu, logits64, case, cap):
    params = SamplingParams(seed=11, **CASES[case])
    probs = reference_probs(logits64, params, HISTORY)
    for nudge in (0.999, 1.001):  # the fixture keeps the filter boundaries clear of f32 rounding
        top_p = params.top_p if params.top_p == 1 else params.top_p * nudge
        near = SamplingParams(**{**CASES[case], "top_p": top_p, "min_p": params.min_p * nudge})
        assert np.array_equal(reference_probs(logits64, near, HISTORY) > 0, probs > 0)
    got = sample(gpu, logits64, params, DRAWS, HISTORY, cap=cap)
    check_distribution(got, probs)


def test_workgroup_reduction_path(any_gpu, logits64):
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=5)
    got = sample(any_gpu, logits64, params, 4000)
    check_distribution(got, reference_probs(logits64, params))


def big_logits():
    """Background far below a few planted tokens; ids 0 and BIG_V-1 test the ends of the range."""
    x = (np.random.default_rng(7).standard_normal(BIG_V) - 4).astype(np.float32)
    planted = [BIG_V - 1, 7, 100_000, 0]
    x[planted] = [12.0, 11.9, 11.9, 11.7]  # a tie in the middle; the last one is the first filtered out
    return x, planted


# cap 2 forces the bisections over all 151,936 logits.
@pytest.mark.parametrize("case,cap,draws", [(dict(top_k=2), 512, 48), (dict(top_p=0.7), 512, 48),
                                            (dict(min_p=0.8), 512, 48), (dict(top_k=3, top_p=0.7), 2, 16)])
def test_large_vocab_keeps_exactly_the_filtered_set(gpu, case, cap, draws):
    logits, planted = big_logits()
    params = SamplingParams(temperature=1.0, seed=3, **case)
    probs = reference_probs(logits, params)
    assert set(np.flatnonzero(probs)) == set(planted[:3])
    got = sample(gpu, logits, params, draws, wg=256, cap=cap)
    assert set(got.tolist()) == set(planted[:3])


def test_same_seed_same_tokens(gpu, logits64):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.97, seed=2**40 + 17)
    a = sample(gpu, logits64, params, 256)
    b = sample(gpu, logits64, params, 256)
    c = sample(gpu, logits64, SamplingParams(**{**vars(params), "seed": 18}), 256)
    assert np.array_equal(a, b)
    assert np.mean(a != c) > 0.3


@pytest.mark.parametrize("V,wg", [(64, 16), (BIG_V, 256)])
def test_temperature_zero_is_argmax(gpu, rng, V, wg):
    logits = rng.standard_normal(V).astype(np.float32)
    logits[[V - 1, 30, 50]] = 9.0  # ties: the lowest index wins
    got = sample(gpu, logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=9), 3, wg=wg)
    tokens, ring = poisoned(gpu, "tokens", (1,), np.uint32), poisoned(gpu, "ring", (1,), np.uint32)
    run(gpu, "argmax", dict(WG=256, VOCAB=V, PARTS=0), [gpu.upload("l", logits), tokens, ring, step_uniform(gpu)], (1,))
    assert got.tolist() == [30] * 3
    assert read(gpu, ring, (1,), np.uint32).tolist() == [30]


def test_greedy_applies_the_penalty(gpu):
    logits = np.zeros(64, np.float32)
    logits[[1, 2, 3]] = [3.0, 2.5, -1.0]
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(gpu, logits, params, 1, history=[1]).tolist() == [2]  # 3.0 / 1.5 < 2.5
    assert sample(gpu, logits, params, 1, history=[2]).tolist() == [1]


def test_penalty_kernel_edits_logits_and_keeps_the_window(gpu, rng):
    V, pos0 = 64, 1500  # past the window capacity, so slots wrap
    logits = rng.standard_normal(V).astype(np.float32) * 3
    history = rng.integers(0, V, pos0).tolist() + [V + 5]  # an out-of-vocab id is stored but never applied
    chunk = np.array([4, 4, 19], np.uint32)  # this forward feeds three ids at pos0..pos0+2
    params = SamplingParams(repetition_penalty=1.3, penalty_window=20)
    lb = gpu.upload("logits", logits)
    step = step_uniform(gpu, n_tokens=3, pos0=pos0 + 1, out_index=0)
    sampler = GpuSampler(gpu, V, lb, gpu.upload("tokens", chunk), poisoned(gpu, "ring", (4,), np.uint32), step,
                         wg=16)
    sampler.set_params(params)
    sampler.set_history(history)
    rec = Recorder(gpu, "penalty")
    rec.dispatch(sampler.p_penalty, sampler.bg_penalty, 1)
    rec.submit()
    fed = history + chunk.tolist()
    window = read(gpu, sampler.window, (WINDOW,), np.uint32)
    pos = np.arange(len(fed) - WINDOW, len(fed))
    assert np.array_equal(window[pos % WINDOW], np.array(fed, np.uint32)[pos])
    recent = np.unique([i for i in fed[-20:] if i < V])
    want = logits.astype(np.float64)
    want[recent] = np.where(want[recent] < 0, want[recent] * 1.3, want[recent] / 1.3)
    np.testing.assert_allclose(read(gpu, lb, (V,)), want, rtol=1e-6)


def test_set_history_clears_old_slots(gpu):
    sampler = GpuSampler(gpu, 64, gpu.buffer("l", 256), gpu.buffer("t", 16), gpu.buffer("r", 16),
                         step_uniform(gpu), wg=16)
    sampler.set_history([1, 2, 3])
    window = read(gpu, sampler.window, (WINDOW,), np.uint32)
    assert window[:3].tolist() == [1, 2, 3] and np.all(window[3:] == NO_TOKEN)


# ---- parameters and the reference --------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0),
    dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=2.0), dict(repetition_penalty=0.0), dict(seed=-1),
    dict(seed=2**64), dict(penalty_window=0), dict(penalty_window=WINDOW + 1), dict(top_k=True),
])
def test_bad_params_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_from_generation_config(tmp_path):
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [151645]}
    p = SamplingParams.from_generation_config(qwen3)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.6, 20, 0.95, 0.0, 1.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({**qwen3, "do_sample": False}))
    assert SamplingParams.from_generation_config(tmp_path).temperature == 0.0
    # transformers' defaults: no do_sample means greedy; sampling without top_k means top_k 50
    assert SamplingParams.from_generation_config({"temperature": 0.7}).temperature == 0.0
    assert SamplingParams.from_generation_config({"do_sample": True}).top_k == 50
    (tmp_path / "bare").mkdir()
    bare = SamplingParams.from_generation_config(tmp_path / "bare", seed=4)
    assert (bare.temperature, bare.seed) == (0.0, 4)
    with pytest.raises(ModelFormatError, match="nowhere: missing"):
        SamplingParams.from_generation_config(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelFormatError, match="bad.json: not valid JSON"):
        SamplingParams.from_generation_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"do_sample": True, "top_p": 7})
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_generation_config(qwen3, topk=3)


@pytest.mark.model
def test_reference_matches_transformers_processors(rng):
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = rng.standard_normal(500) * 3
    history = rng.integers(0, 500, 40)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            penalty_window=WINDOW)
    procs = [lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(50),
             lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.01)]
    ids, scores = torch.tensor(history[None]), torch.tensor(logits[None])
    for proc in procs:
        scores = proc(ids, scores)
    want = torch.softmax(scores, -1)[0].numpy()
    np.testing.assert_allclose(reference_probs(logits, params, history), want, atol=1e-12)
