"""Tests of paged.core.engine.sampler: greedy, seeds, filters (statistically), penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from paged.core.engine.request import Request
from paged.core.engine.sampler import Sampler, SamplerOutput, TokenLogprobs, greedy_ids
from paged.core.sampling_params import SamplingParams

EOS = 7


def make_req(rid: str, prompt=(1, 2, 3), output=(), eos=EOS, params: SamplingParams | None = None, **kw) -> Request:
    params = params or SamplingParams(**kw)
    req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, eos_token_id=eos)
    for t in output:
        req.append_output_token(t)
    return req


# A fixed distribution over 8 tokens, deliberately not sorted by token id.
BASE_PROBS = [0.10, 0.30, 0.02, 0.15, 0.20, 0.04, 0.12, 0.07]
BASE_LOGITS = torch.tensor([math.log(p) for p in BASE_PROBS], dtype=torch.float32)


def expected_probs(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """Independent reference in plain Python: temperature, top-k, top-p, min-p, renormalised."""
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    w = [math.exp(x - m) for x in scaled]
    order = sorted(range(len(w)), key=lambda i: -w[i])
    keep = set(order[:top_k]) if top_k else set(order)
    z = sum(w[i] for i in keep)
    cum, kept_p = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        kept_p.add(i)
        cum += w[i] / z
        if cum >= top_p:
            break
    pmax = max(w)
    final = {i for i in kept_p if w[i] >= min_p * pmax}
    z = sum(w[i] for i in final)
    return [w[i] / z if i in final else 0.0 for i in range(len(w))]


def check_frequencies(tokens: list[int], probs: list[float], sigmas: float = 5.0) -> None:
    n = len(tokens)
    counts = [0] * len(probs)
    for t in tokens:
        counts[t] += 1
    for tok, (c, p) in enumerate(zip(counts, probs)):
        if p == 0.0:
            assert c == 0, f"token {tok} is filtered out but was sampled {c} times"
        else:
            sd = math.sqrt(n * p * (1 - p))
            assert abs(c - n * p) <= sigmas * sd + 1, f"token {tok}: {c} samples, expected {n * p:.0f} ± {sd:.0f}"


def sample_many(params: SamplingParams, n: int = 20000, logits: torch.Tensor = BASE_LOGITS, seed: int = 0) -> list[int]:
    """n independent samples in one batch (one row per request)."""
    sampler = Sampler(vocab_size=logits.shape[0], device="cpu", seed=seed)
    reqs = [make_req(f"r{i}", params=params) for i in range(n)]
    out = sampler.sample(logits.expand(n, -1), reqs)
    assert len(out.token_ids) == n
    return out.token_ids


# ------------------------------------------------------------------ greedy


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    sampler = Sampler(1000, "cpu")
    reqs = [make_req(f"g{i}", temperature=0.0) for i in range(16)]
    out = sampler.sample(logits, reqs)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    # Low-precision logits are handled too.
    out16 = sampler.sample(logits.to(torch.bfloat16), reqs)
    assert out16.token_ids == logits.to(torch.bfloat16).float().argmax(-1).tolist()


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_greedy_takes_the_first_of_tied_maxima(rows):
    """Rounded logits tie (bf16 steps of 0.125 near 25): greedy picks the lowest token id among
    the tied maxima, in every row, checked in plain Python; every path of the sampler (the plain
    greedy batch, greedy rows beside logprobs, beside sampled rows) picks the same."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randint(0, 40, (rows, 49152), generator=g).float() / 8 + 20  # many ties at the max
    maxima = [(row, max(row)) for row in logits.tolist()]
    first_max = [row.index(top) for row, top in maxima]
    assert all(row.count(top) > 1 for row, top in maxima)  # every row's max is tied
    sampler = Sampler(49152, "cpu", seed=0)
    assert sampler.sample(logits, [make_req(f"t{i}", temperature=0.0) for i in range(rows)]).token_ids == first_max
    with_logprobs = [make_req(f"l{i}", temperature=0.0, logprobs=1) for i in range(rows)]
    assert sampler.sample(logits, with_logprobs).token_ids == first_max
    mixed = [make_req(f"m{i}", temperature=0.0 if i % 2 == 0 else 1.0) for i in range(rows)]
    got = sampler.sample(logits, mixed).token_ids
    assert [got[i] for i in range(0, rows, 2)] == first_max[::2]


def _first_argmax(row: list[float]) -> int:
    """The first index of the row's maximum, or of its first NaN: plain Python."""
    for i, v in enumerate(row):
        if v != v:
            return i
    top = max(row)
    return row.index(top)


@pytest.mark.parametrize("vocab", [49152, 49152 + 300, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_by_chunks_is_the_first_maximum(vocab, dtype):
    """greedy_ids from 8 rows (by chunks) against plain Python: ties inside a chunk and across
    chunks, a maximum in the short last chunk and at its end, NaN (the first one wins), rows of
    -inf, +inf, a padded vocabulary's column slice (not contiguous)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 60, (12, vocab + 7), generator=g).float() / 8  # many ties
    logits[0, 5], logits[0, 40000] = float("nan"), float("nan")
    logits[1] = float("-inf")
    logits[2, vocab - 200], logits[2, vocab - 100] = 1e9, 1e9  # the last chunk
    logits[3, vocab - 1] = 1e9
    logits[4, 1023], logits[4, 1024], logits[4, vocab - 1] = 99.0, 99.0, 99.0  # across a chunk boundary
    logits[5, vocab - 1] = float("nan")
    logits[6, 3000], logits[6, 9] = float("inf"), float("inf")
    logits[7, :] = 2.0
    logits[:, vocab:] = 1e12  # padding columns beyond the vocabulary: sliced off below
    logits = logits.to(dtype)[:, :vocab]
    assert not logits.is_contiguous()
    expected = [_first_argmax(row) for row in logits.float().tolist()]
    assert greedy_ids(logits).tolist() == expected
    assert greedy_ids(logits.contiguous()).tolist() == expected
    assert greedy_ids(logits[:3]).tolist() == expected[:3]  # below 8 rows: max(dim)


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    reqs = [make_req(f"m{i}", temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    out = Sampler(300, "cpu", seed=3).sample(logits, reqs)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(3, 12)
    logits[:, 10:] = 100.0  # padding beyond vocab_size=10
    reqs = [make_req("a", temperature=0.0), make_req("b"), make_req("c", top_k=3)]
    out = Sampler(10, "cpu", seed=0).sample(logits, reqs)
    assert all(t < 10 for t in out.token_ids)


# ------------------------------------------------------------------- seeds


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(vocab, generator=g) * 2.0


def _run_seeded(batches: list[tuple[list[Request], int]], steps: int, vocab: int, sampler_seed: int) -> list[int]:
    """Run `steps` steps; at each step the batch is batches[step % len]. Return the tokens of 'target'."""
    sampler = Sampler(vocab, "cpu", seed=sampler_seed)
    got = []
    for step in range(steps):
        reqs, _ = batches[step % len(batches)]
        rows = []
        for r in reqs:
            row = _step_logits(step, vocab) if r.request_id == "target" else torch.randn(vocab) * 3
            rows.append(row)
        out = sampler.sample(torch.stack(rows), reqs)
        for r, t in zip(reqs, out.token_ids):
            r.append_output_token(t)
            if r.request_id == "target":
                got.append(t)
    return got


def test_seeded_request_is_independent_of_batch():
    vocab, steps = 500, 12
    target_params = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=1234, max_tokens=100)

    def target():
        return make_req("target", params=target_params)

    alone = _run_seeded([([target()], 0)], steps, vocab, sampler_seed=1)

    t = target()
    others = [
        make_req("u1"),
        make_req("s1", seed=99),
        make_req("gr", temperature=0.0),
        make_req("pp", top_p=0.5, min_p=0.1, temperature=0.7),
        make_req("s2", seed=1234),  # same seed, different request: own generator
        make_req("lp", logprobs=3, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    # Position and companions change from step to step; different sampler seed.
    batches = [
        ([others[0], t, others[1]], 0),
        ([t], 0),
        ([others[2], others[3], others[4], others[5], t], 0),
        ([others[1], t, others[2], others[0]], 0),
    ]
    mixed = _run_seeded(batches, steps, vocab, sampler_seed=2)
    assert alone == mixed
    assert len(set(alone)) > 3  # the test actually samples

    other_seed = _run_seeded([([make_req("target", params=target_params.copy(seed=4321))], 0)], steps, vocab, 1)
    assert other_seed != alone


def test_forget_restarts_the_seeded_stream():
    vocab = 1000
    logits = torch.zeros(1, vocab)
    sampler = Sampler(vocab, "cpu")
    req = make_req("x", seed=7)
    first = [sampler.sample(logits, [req]).token_ids[0] for _ in range(5)]
    sampler.forget(["x"])
    again = [sampler.sample(logits, [req]).token_ids[0] for _ in range(5)]
    assert first == again
    assert len(set(first)) > 1  # advanced once per token


def test_unseeded_requests_differ_across_rows():
    tokens = sample_many(SamplingParams(), n=200, logits=torch.zeros(1000))
    assert len(set(tokens)) > 150


# -------------------------------------------------------- filters (statistics)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=3),
        dict(top_p=0.6),
        dict(min_p=0.3),
        dict(top_k=5, top_p=0.7),
        dict(temperature=0.7, top_p=0.8, min_p=0.2),
        dict(temperature=0.5),
        dict(temperature=2.0),
        dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain",
)
def test_filters_statistically(kw):
    expected = expected_probs(BASE_LOGITS.tolist(), **kw)
    tokens = sample_many(SamplingParams(**kw), n=20000, seed=11)
    check_frequencies(tokens, expected)


def test_reference_sets_are_what_we_think():
    # Guard the reference itself on hand-checked cases (sorted probs .30 .20 .15 .12 .10 .07 .04 .02).
    nz = lambda kw: {i for i, p in enumerate(expected_probs(BASE_LOGITS.tolist(), **kw)) if p > 0}  # noqa: E731
    assert nz(dict(top_k=3)) == {1, 4, 3}
    assert nz(dict(top_p=0.6)) == {1, 4, 3}  # .30 + .20 = .50 < .6 <= .65
    assert nz(dict(min_p=0.3)) == {1, 4, 3, 6, 0}  # p >= .09
    assert nz(dict(top_k=5, top_p=0.7)) == {1, 4, 3}  # renormalised over .87: .345 .575 .747


def test_top_p_keeps_top_token_even_if_alone():
    probs = [0.9, 0.05, 0.05]
    logits = torch.tensor([math.log(p) for p in probs])
    tokens = sample_many(SamplingParams(top_p=0.01), n=2000, logits=logits)
    assert set(tokens) == {0}


def test_seeded_rows_follow_the_distribution():
    kw = dict(top_p=0.8, temperature=0.9)
    n = 5000
    reqs = [make_req(f"s{i}", seed=i, **kw) for i in range(n)]
    out = Sampler(8, "cpu").sample(BASE_LOGITS.expand(n, -1), reqs)
    check_frequencies(out.token_ids, expected_probs(BASE_LOGITS.tolist(), **kw))


def test_temperature_effect():
    cold = sample_many(SamplingParams(temperature=0.05), n=2000)
    assert cold.count(int(BASE_LOGITS.argmax())) > 1990
    hot = sample_many(SamplingParams(temperature=5.0), n=20000)
    assert len(set(hot)) == 8
    # Hotter = flatter: the least likely token (id 2, p=.02) is far more frequent than at T=1.
    assert hot.count(2) > 3 * 0.02 * 20000


# --------------------------------------------------------------- penalties


def _penalised_logprobs(logits: torch.Tensor, req: Request) -> list[float]:
    lp = Sampler(logits.shape[-1], "cpu", seed=0).sample(logits[None], [req]).logprobs[0]
    by_tok = dict(lp.top)
    return [by_tok[i] for i in range(logits.shape[-1])]


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - z for x in xs]


def test_penalties_hand_computed():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    req = make_req(
        "p",
        prompt=[0, 1],
        output=[3, 3, 2],
        eos=None,
        temperature=0.0,
        logprobs=6,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # Repetition (prompt + output = {0, 1, 2, 3}): 2 -> 1, -1 -> -2, .5 -> .25, 3 -> 1.5.
    # Frequency/presence over output (3 twice, 2 once): 3: 1.5 - 1 - .25 = .25; 2: .25 - .5 - .25 = -.5.
    want = [1.0, -2.0, -0.5, 0.25, -2.0, 1.0]
    got = _penalised_logprobs(logits, req)
    for g, w in zip(got, _log_softmax(want)):
        assert g == pytest.approx(w, abs=1e-5)


def test_penalties_each_alone_and_unpenalised_rows_untouched():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    cases = [
        (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, 6.0, -2.0, 1.0]),  # < 1 encourages repeats
        (dict(frequency_penalty=-1.0), [2.0, -1.0, 1.5, 5.0, -2.0, 1.0]),
        (dict(presence_penalty=1.5), [2.0, -1.0, -1.0, 1.5, -2.0, 1.0]),
    ]
    for kw, want in cases:
        pen = make_req("p", prompt=[0, 1], output=[3, 3, 2], eos=None, temperature=0.0, logprobs=6, **kw)
        plain = make_req("q", prompt=[0, 1], output=[3, 3, 2], eos=None, temperature=0.0, logprobs=6)
        out = Sampler(6, "cpu").sample(torch.stack([logits, logits]), [plain, pen])
        got = [dict(out.logprobs[1].top)[i] for i in range(6)]
        for g, w in zip(got, _log_softmax(want)):
            assert g == pytest.approx(w, abs=1e-5), kw
        untouched = [dict(out.logprobs[0].top)[i] for i in range(6)]
        for g, w in zip(untouched, _log_softmax(logits.tolist())):
            assert g == pytest.approx(w, abs=1e-5)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    req = make_req("r", prompt=[1], temperature=0.0, repetition_penalty=1.5, eos=None)
    assert Sampler(4, "cpu").sample(logits, [req]).token_ids == [2]  # 3 / 1.5 = 2 < 2.5


# -------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_token_ids():
    vocab = 10
    logits = torch.zeros(vocab)
    logits[EOS] = 10.0
    logits[5] = 9.0  # a stop token id
    logits[3] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], logprobs=2)
    req = make_req("m", params=params)
    sampler = Sampler(vocab, "cpu")
    for _ in range(3):
        out = sampler.sample(logits[None], [req])
        assert out.token_ids == [3]
        assert out.logprobs[0].rank == 1  # EOS and the stop token are masked out of the logprobs too
        req.append_output_token(out.token_ids[0])
    assert sampler.sample(logits[None], [req]).token_ids == [EOS]


def test_min_tokens_random_sampling_and_ignore_eos():
    vocab = 10
    logits = torch.zeros(vocab)
    logits[EOS] = 20.0
    logits[5] = 19.0
    reqs = [make_req(f"m{i}", min_tokens=2, stop_token_ids=[5]) for i in range(200)]
    out = Sampler(vocab, "cpu", seed=5).sample(logits.expand(200, -1), reqs)
    assert EOS not in out.token_ids and 5 not in out.token_ids
    # With ignore_eos, EOS is not a stop token, so min_tokens leaves it alone (as in vLLM).
    r = make_req("ie", temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler(vocab, "cpu").sample(logits[None], [r]).token_ids == [EOS]


# --------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax(dtype):
    torch.manual_seed(2)
    vocab = 50
    logits = (torch.randn(5, vocab) * 2).to(dtype)
    reqs = [
        make_req("a", logprobs=5),
        make_req("b", logprobs=0, temperature=0.8, top_p=0.9),
        make_req("c"),  # no logprobs
        make_req("d", logprobs=3, temperature=0.0),
        make_req("e", logprobs=20, top_k=4, temperature=1.5),
    ]
    out = Sampler(vocab, "cpu", seed=9).sample(logits, reqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i, r in enumerate(reqs):
        lp = out.logprobs[i]
        if r.sampling_params.logprobs is None:
            continue
        assert isinstance(lp, TokenLogprobs)
        tok = out.token_ids[i]
        assert lp.token_id == tok
        # Raw (pre-temperature, pre-filter) distribution, whatever the sampling settings.
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        k = r.sampling_params.logprobs
        assert len(lp.top) == k
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        want_ids = ref[i].topk(k).indices.tolist() if k else []
        assert [t for t, _ in lp.top] == want_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[i, t]), abs=1e-5)
    assert out.logprobs[3].rank == 1  # greedy


def test_logprob_rank_of_a_sampled_unlikely_token():
    logits = torch.tensor([[5.0, 0.0, 4.0, 3.0]])
    req = make_req("u", logprobs=1, top_k=4, temperature=1.0, seed=0)
    sampler = Sampler(4, "cpu")
    seen = {}
    for _ in range(300):
        out = sampler.sample(logits, [req])
        seen[out.token_ids[0]] = out.logprobs[0].rank
    assert seen.get(0) == 1 and seen.get(2) == 2 and seen.get(3) == 3


def test_top_p_candidate_stages_match_a_full_sort():
    # Peaked rows are settled among the top 256 tokens, moderate ones among 4096, flat ones need the
    # full sort: all must keep exactly the set a float64 full sort keeps.
    from paged.core.engine.sampler import _top_p

    gen = torch.Generator().manual_seed(5)
    vocab = 20000
    scales = [12.0, 6.0, 3.0, 2.0, 1.0, 0.2, 6.0]
    ps = [0.9, 0.95, 0.5, 0.5, 0.9, 0.99, 0.3]
    logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    got = torch.isfinite(_top_p(logits, ps))
    probs = torch.softmax(logits.double(), dim=-1)
    vals, idx = probs.sort(dim=-1, descending=True)
    above = vals.cumsum(-1) - vals
    for r, p in enumerate(ps):
        want = torch.zeros(vocab, dtype=torch.bool)
        want[idx[r][above[r] < p]] = True
        differ = (got[r] != want).nonzero().flatten()
        # Only float32-vs-float64 rounding right at the boundary may differ.
        for t in differ.tolist():
            pos = int((idx[r] == t).nonzero())
            assert abs(float(above[r, pos]) - p) < 1e-4
        assert got[r].sum() >= 1
        kept_logits = _top_p(logits[r : r + 1], [p])  # alone: the same set
        assert torch.equal(torch.isfinite(kept_logits[0]), got[r])
    sizes = got.sum(-1).tolist()
    assert min(sizes) < 256 and any(256 < n < 4096 for n in sizes) and max(sizes) > 4096  # all stages used


def test_inverse_cdf_is_exact_for_tiny_probabilities():
    # One token with weight 1, then 8191 tokens of weight 1e-9 each: a float32 running sum near 1
    # cannot even see them; the two-level float64 sum must map u to the right one.
    from paged.core.engine.sampler import _inverse_cdf

    vocab = 8192
    w = torch.full((1, vocab), 1e-9, dtype=torch.float32)
    w[0, 0] = 1.0
    w64 = w.double()[0]
    total = float(w64.sum())
    cum = w64.cumsum(0)
    for j in (1, 17, 4000, 8191):
        mid = float(cum[j] - w64[j] / 2)  # the middle of token j's interval
        u = torch.tensor([1.0 - mid / total], dtype=torch.float64)
        assert abs(int(_inverse_cdf(w, u)) - j) <= 1
    assert int(_inverse_cdf(w, torch.tensor([0.5], dtype=torch.float64))) == 0


@pytest.mark.parametrize("vocab", [8, 1000, 5000, 49152])
def test_inverse_cdf_never_picks_zero_weight_tokens(vocab):
    from paged.core.engine.sampler import _inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    w = torch.rand(64, vocab, generator=gen)
    w[w < 0.7] = 0.0  # ~70% zeros, in runs at the ends too
    w[:, :3] = 0.0
    w[:, -3:] = 0.0
    w[:, vocab // 2] += 0.01  # every row has some mass
    w[0] = 0.0
    w[0, vocab // 2] = 1.0  # a single non-zero
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[1], u[2] = 0.0, 1.0 - 2**-53  # the extreme uniforms
    tok = _inverse_cdf(w, u)
    assert tok.shape == (64,)
    assert bool((w.gather(1, tok[:, None]) > 0).all())
    assert int(tok[0]) == vocab // 2
    # u = 0 targets the whole mass: the last non-zero token.
    assert int(tok[1]) == int(w[1].nonzero().max())
    assert int(tok[2]) == int(w[2].nonzero().min())


def test_callers_logits_are_not_modified_and_empty_batch():
    torch.manual_seed(3)
    logits = torch.randn(6, 64)
    before = logits.clone()
    reqs = [
        make_req("a", top_k=5),
        make_req("b", top_p=0.5, seed=1),
        make_req("c", min_p=0.2, temperature=0.5),
        make_req("d", temperature=0.0, logprobs=2),
        make_req("e", output=[3, 4], repetition_penalty=1.5, presence_penalty=1.0, min_tokens=5),
        make_req("f"),
    ]
    sampler = Sampler(64, "cpu", seed=0)
    sampler.sample(logits, reqs)
    sampler.sample(logits[:3], reqs[:3])  # all random rows: no copy up front
    assert torch.equal(logits, before)
    assert sampler.sample(torch.empty(0, 64), []) == SamplerOutput(token_ids=[], logprobs=[])


def test_any_integer_seed_is_accepted():
    logits = torch.zeros(2, 100)
    reqs = [make_req("neg", seed=-5), make_req("huge", seed=2**80 + 3)]
    out = Sampler(100, "cpu").sample(logits, reqs)
    assert len(out.token_ids) == 2


# ------------------------------------------- logit bias, allowed tokens, bad words


def test_logit_bias_is_added_before_logprobs_and_the_choice():
    """Against plain Python: the logprobs are log_softmax(logits + bias), the greedy pick its argmax."""
    torch.manual_seed(5)
    logits = torch.randn(3, 12)
    biases = [{3: 100.0}, {0: -100.0, 5: 2.5, 11: -0.75}, {}]
    reqs = [make_req(f"b{i}", temperature=0.0, logprobs=12, logit_bias=b or None) for i, b in enumerate(biases)]
    out = Sampler(12, "cpu").sample(logits, reqs)
    for i, bias in enumerate(biases):
        row = [float(x) + bias.get(t, 0.0) for t, x in enumerate(logits[i])]
        assert out.token_ids[i] == max(range(12), key=lambda t: row[t])
        got = dict(out.logprobs[i].top)
        for t, expected in enumerate(_log_softmax(row)):
            assert got[t] == pytest.approx(expected, abs=1e-5)
    assert out.token_ids[0] == 3


def test_allowed_token_ids_leave_only_those_tokens():
    torch.manual_seed(6)
    allowed = [2, 5, 9]
    logits = torch.randn(400, 10)
    reqs = [make_req(f"a{i}", temperature=1.0, allowed_token_ids=allowed) for i in range(399)]
    reqs.append(make_req("plain", temperature=0.0))  # a row without the rule keeps its argmax
    out = Sampler(10, "cpu", seed=1).sample(logits, reqs)
    assert set(out.token_ids[:-1]) == set(allowed)  # every allowed token is drawn, nothing else
    assert out.token_ids[-1] == int(logits[-1].argmax())
    greedy = Sampler(10, "cpu").sample(logits[:1], [make_req("g", temperature=0.0, allowed_token_ids=allowed)])
    assert greedy.token_ids == [max(allowed, key=lambda t: float(logits[0, t]))]


@pytest.mark.parametrize("output,banned", [
    ((), {4}),            # nothing generated yet: only the one-token word applies
    ((1, 8), {4, 6}),     # the output ends with 8: "8 6" would complete, 6 is banned
    ((8, 1), {4}),        # 8 is not last: 6 is fine
    ((2, 3, 8), {4, 6, 9}),  # "3 8 9" is complete but for its last token
])
def test_bad_words_ban_the_token_that_would_complete_a_word(output, banned):
    words = [[4], [8, 6], [3, 8, 9]]
    logits = torch.zeros(1, 10)
    req = make_req("w", output=output, temperature=0.0, logprobs=10, bad_words_token_ids=words)
    lp = dict(Sampler(10, "cpu").sample(logits, [req]).logprobs[0].top)
    assert {t for t, v in lp.items() if v == float("-inf")} == banned
