"""Batched token sampling with per-request parameters.

The model runner calls :meth:`Sampler.sample` once per step with one row of logits per request.
Per row, in this order (the order vLLM uses):

0. structured output: a request with a grammar matcher (``request.grammar``, see
   paged.core.structured_output) fills its row of an int32 bitmask; the rows are unpacked and
   the disallowed tokens of every constrained row set to ``-inf`` in one batched op;
0b. ``allowed_token_ids``: every other token gets ``-inf``; ``bad_words_token_ids``: a word's last
   token gets ``-inf`` where the output so far ends with the word's other tokens (a one-token
   word always); ``logit_bias``: each listed token's bias is added (OpenAI's semantics, so -100
   all but bans a token and +100 all but forces it);
1. repetition penalty (HF semantics) over prompt + output tokens;
2. frequency and presence penalties (OpenAI semantics) over output tokens only;
3. ``min_tokens``: while the request has fewer output tokens, its EOS token (unless
   ``ignore_eos``) and its ``stop_token_ids`` get ``-inf``;
4. logprobs, when asked for, are the ``log_softmax`` of the logits at this point: after the
   penalties and the ``min_tokens`` mask, before temperature / top-k / top-p / min-p. They
   describe the model's (penalised) distribution, not the truncated one that was sampled from,
   so a token outside the top-p set still has a finite logprob and a meaningful rank;
5. greedy (``temperature == 0``): argmax; otherwise divide by the temperature, keep the top-k
   logits (ties with the k-th are kept), renormalise and keep the smallest set whose mass is
   >= top_p (the most likely token always stays), drop tokens whose probability is below
   ``min_p`` times the largest one, and sample.

Sampling is by inverse CDF: one float64 uniform ``u`` per row picks the first token whose
cumulative probability reaches ``1 - u`` (cumulative sums in float64, over blocks of 256 tokens
and then inside the chosen block, so even tokens of probability 1e-9 get exactly their share).
A request with a ``seed`` draws its ``u`` from its own ``torch.Generator`` (created on first use,
kept across steps under its request id, advanced by one draw per sampled token), so its tokens
do not depend on the rest of the batch or on its position: every step is applied row by row
with the request's own parameters only. Unseeded requests share the sampler's generator (seeded
from ``seed`` if given, else from os.urandom). Greedy rows draw nothing. (Drawing one uniform
per token rather than vocabulary-sized noise for an exponential race / Gumbel-max is what makes
sampling cheap on CPU.)

The common cases stay cheap: a batch where nobody uses penalties / ``min_tokens`` / logprobs
and everyone is greedy is a single ``argmax``; penalties touch only the
(row, token) pairs concerned; each filter runs only on the rows that use it; top-k uses
``torch.topk``; top-p looks for its set among the 256 (then 4096) most likely tokens and sorts the
whole vocabulary only for rows whose distribution is too flat for that.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from paged.core.engine.outputs import TokenLogprobs
from paged.core.engine.plugin_faults import describe, log_fault
from paged.core.engine.request import Request

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per request, in order
    logprobs: list[TokenLogprobs | None]  # None where sampling_params.logprobs is None


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Row i's entry for ``token_ids[i]`` with the ``ks[i]`` most likely tokens, from ``logprobs``
    ``[rows, vocab]`` (a ``log_softmax``)."""
    chosen = logprobs.gather(1, token_ids[:, None].long())
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    max_k = max(ks, default=0)
    top_vals = top_idx = None
    if max_k > 0:
        top_vals, top_idx = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
        top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
    chosen_l, toks = chosen[:, 0].tolist(), token_ids.tolist()
    return [TokenLogprobs(token_id=toks[j], logprob=chosen_l[j], rank=ranks[j],
                          top=list(zip(top_idx[j][:k], top_vals[j][:k])) if k > 0 else [])
            for j, k in enumerate(ks)]


def _rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``; ``x`` itself when that is all of its rows."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


# greedy_ids by chunks from this many rows (2-core Xeon, 49,152 / 151,936 float32 logits: 8 rows
# 0.061 / 0.164 ms against max(dim)'s 0.098 / 0.320, 64 rows 0.38 / 0.90 against 0.88 / 2.70; level
# at 4 rows), over vocabularies of at least 4 chunks
_GREEDY_CHUNK = 1024
_GREEDY_CHUNKED_MIN_ROWS = 8


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first index of the row's max, or of its first NaN (as ``argmax`` and
    ``max(dim)``). ``max(dim).indices``, not ``argmax``, which is slower on CPU (2.3 against 0.9
    ms for 64 rows of a 49,152-token vocabulary in float32, 2 threads). From 8 rows, by chunks:
    torch's CPU ``max(dim)`` compares one value at a time with its index, while ``amax`` is
    vectorised, so each row's chunk maxima come from ``amax``, then ``max(dim)`` runs over the one
    chunk that holds the row's first maximum."""
    rows, vocab = logits.shape
    chunk = _GREEDY_CHUNK
    if rows < _GREEDY_CHUNKED_MIN_ROWS or vocab < 4 * chunk:
        return logits.max(dim=-1).indices
    whole = vocab // chunk
    chunk_max = logits[:, : whole * chunk].view(rows, whole, chunk).amax(dim=-1)
    if whole * chunk < vocab:
        chunk_max = torch.cat([chunk_max, logits[:, whole * chunk:].amax(dim=-1, keepdim=True)], dim=1)
    # the first chunk holding the row's max (a NaN is the max: amax and max(dim) propagate it)
    hit = (chunk_max == chunk_max.amax(dim=-1, keepdim=True)) | chunk_max.isnan()
    first = hit.to(torch.uint8).argmax(dim=-1)
    # a window of `chunk` values from that chunk's start; the short last chunk's window starts
    # earlier, in a chunk that holds no maximum, so the window's first maximum is the row's
    starts = (first * chunk).clamp_(max=vocab - chunk)
    window = logits.unfold(1, chunk, 1)[torch.arange(rows, device=logits.device), starts]
    return window.max(dim=-1).indices + starts


# Candidate set sizes for top-p: the kept set is found within the K most likely tokens when their
# mass reaches top_p (almost always at K = 256); a full sort of the vocabulary is the last resort.
_TOP_P_CANDIDATES = (256, 4096)


def _top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep, per row, the smallest most-likely set whose probability is >= top_p."""
    num, vocab = logits.shape
    dev = logits.device
    probs = logits.softmax(dim=-1)
    ps = torch.tensor(top_p, dtype=torch.float32, device=dev)
    out = torch.full_like(logits, _NEG_INF)
    todo = torch.arange(num, device=dev)
    for k in (*_TOP_P_CANDIDATES, vocab):
        k = min(k, vocab)
        sub = probs[todo] if todo.numel() < num else probs
        if k < vocab:
            vals, idx = sub.topk(k, dim=-1)
        else:
            vals, idx = sub.sort(dim=-1, descending=True)
        cum = vals.cumsum(dim=-1)
        row_ps = ps[todo][:, None]
        # Token j stays while the mass strictly above it is < top_p; the top token always stays.
        keep = (cum - vals) < row_ps
        keep[:, 0] = True
        done = (cum[:, -1] >= row_ps[:, 0]) if k < vocab else torch.ones_like(keep[:, 0])
        if bool(done.all()):
            rows, sel_idx, sel_keep = todo, idx, keep
        else:
            rows, sel_idx, sel_keep = todo[done], idx[done], keep[done]
        if rows.numel():
            src = logits if rows.numel() == num else logits[rows]
            kept = src.gather(1, sel_idx).masked_fill_(~sel_keep, _NEG_INF)
            if rows.numel() == num:
                out.scatter_(1, sel_idx, kept)
            else:
                out[rows[:, None], sel_idx] = kept
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return out


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight reaches ``(1 - u) * total``.

    ``weights`` [rows, vocab] >= 0 (each row with a positive sum), ``u`` [rows] float64 in
    [0, 1). Picks token i with probability weights[i] / total; a zero-weight token is never
    picked. Two levels, so that only small cumulative sums are needed and they can be float64
    (a float32 cumulative sum over the whole vocabulary would round the weight of each token
    below ~1e-7 to a multiple of the float32 spacing near 1): block sums over blocks of up to
    256 tokens, then the cumulative sum inside the chosen block.
    """
    rows, vocab = weights.shape
    dev = weights.device
    block = min(256, vocab)
    while vocab % block and block > 32:
        block //= 2
    if vocab % block:
        weights = torch.nn.functional.pad(weights, (0, block - vocab % block))
    blocks = weights.view(rows, -1, block)
    mass = blocks.sum(dim=-1).to(torch.float64)  # [rows, n_blocks]
    cum = mass.cumsum(dim=-1)
    target = (1.0 - u)[:, None] * cum[:, -1:]  # in (0, total]
    b = torch.searchsorted(cum, target).clamp_(max=mass.shape[1] - 1)  # [rows, 1]: first cum >= target
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    frac = (target - before) / mass.gather(1, b)  # in (0, 1] up to rounding
    inner = blocks[torch.arange(rows, device=dev), b[:, 0]].to(torch.float64).cumsum(dim=-1)  # [rows, block]
    inner_target = torch.minimum(frac * inner[:, -1:], inner[:, -1:])
    inner_target = torch.maximum(inner_target, torch.full_like(inner_target, torch.finfo(torch.float64).tiny))
    t = torch.searchsorted(inner, inner_target).clamp_(max=block - 1)
    return (b * block + t)[:, 0]


class Sampler:
    """Samples one token per request from a batch of logits."""

    def __init__(self, vocab_size: int, device, seed: int | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        self._generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        self._bitmask = torch.empty(0, (self.vocab_size + 31) // 32, dtype=torch.int32)  # grown on demand
        self.grammar_code = None  # the structured-output backend's PluginCode, to name it in failures
        # bit j of an int32 word (1 << 31 wraps to the sign bit, which is what the word holds)
        self._bits = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(self.device)

    # ------------------------------------------------------------------ state

    def forget(self, request_ids: Iterable[str] | str) -> None:
        """Drop per-request state (seeded generators) of requests that are finished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self._seeded.pop(rid, None)

    def _generator_for(self, request: Request) -> torch.Generator:
        gen = self._seeded.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling_params.seed % (1 << 64))  # any int is a valid seed
            self._seeded[request.request_id] = gen
        return gen

    # --------------------------------------------------------------- sampling

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        num = len(requests)
        if logits.dim() != 2 or logits.shape[0] != num:
            raise ValueError(f"logits must be [len(requests)={num}, vocab], got {tuple(logits.shape)}")
        if num == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        if logits.shape[1] > self.vocab_size:  # padded vocabulary: ignore the padding columns
            logits = logits[:, : self.vocab_size]
        params = [r.sampling_params for r in requests]

        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        min_tok_rows = [i for i, (r, p) in enumerate(zip(requests, params)) if len(r.output_token_ids) < p.min_tokens]
        want_logprobs = any(p.logprobs is not None for p in params)
        all_greedy = all(p.temperature == 0.0 for p in params)
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated()]
        token_rows = [i for i, p in enumerate(params)
                      if p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids]

        # Fast path: a plain greedy batch is one argmax. (The float32 conversion is exact; on CPU,
        # where half-precision argmax is slow, converting first is faster.)
        if all_greedy and not (use_rep or use_freq_pres or min_tok_rows or want_logprobs or grammar_rows or token_rows):
            if logits.device.type == "cpu":
                logits = logits.to(torch.float32)
            return SamplerOutput(token_ids=greedy_ids(logits).tolist(), logprobs=[None] * num)

        copied = bool(use_rep or use_freq_pres or min_tok_rows or grammar_rows or token_rows)
        if copied:
            # One private float32 copy that the masks and the penalties then edit in place.
            logits = logits.to(torch.float32, copy=True)
            if grammar_rows:
                self._apply_grammar_masks(logits, requests, grammar_rows)
            if token_rows:
                self._apply_token_rules(logits, requests, token_rows)
            if use_rep or use_freq_pres:
                self._apply_penalties(logits, requests, use_rep, use_freq_pres)
            if min_tok_rows:
                self._apply_min_tokens(logits, requests, min_tok_rows)
        else:
            logits = logits.to(torch.float32)  # may be the caller's tensor: not written to below

        lp_rows: list[int] = []
        logprobs_all = None
        if want_logprobs:
            lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            logprobs_all = torch.log_softmax(_rows_of(logits, lp_rows), dim=-1)

        if all_greedy:
            token_ids = greedy_ids(logits)
        else:
            random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
            private = copied or len(random_rows) < num  # x[idx] is a copy
            sampled = self._sample_random(_rows_of(logits, random_rows), [requests[i] for i in random_rows], private)
            if len(random_rows) == num:
                token_ids = sampled
            else:
                greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
                token_ids = torch.empty(num, dtype=torch.long, device=logits.device)
                greedy = greedy_ids(_rows_of(logits, greedy_rows))
                token_ids[torch.tensor(greedy_rows, device=logits.device)] = greedy
                token_ids[torch.tensor(random_rows, device=logits.device)] = sampled

        out_logprobs: list[TokenLogprobs | None] = [None] * num
        if logprobs_all is not None:
            self._fill_logprobs(out_logprobs, logprobs_all, lp_rows, token_ids, params)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=out_logprobs)

    # ------------------------------------------------------- structured output

    def _apply_grammar_masks(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """Each constrained row's matcher fills its bitmask row (on the CPU, where the matchers
        live); then one batched op unpacks the bits and masks every constrained row."""
        num_rows, vocab = len(rows), logits.shape[1]
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty(max(num_rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1], dtype=torch.int32)
        bitmask = self._bitmask[:num_rows]
        for j, i in enumerate(rows):
            try:
                requests[i].grammar.fill_bitmask(bitmask, j)
            except Exception as e:  # this request ends (the scheduler sees ``error``); the others go on
                code = self.grammar_code
                requests[i].error = describe(e, [code], code, "fill_bitmask")
                log_fault(requests[i].error, e, request_id=requests[i].request_id)
                bitmask[j].fill_(-1)
        words = bitmask.to(logits.device, non_blocking=True)
        banned = ((words[:, :, None] & self._bits) == 0).view(num_rows, -1)[:, :vocab]
        if num_rows == logits.shape[0]:
            logits.masked_fill_(banned, _NEG_INF)
        else:
            idx = torch.tensor(rows, device=logits.device)
            logits[idx] = logits[idx].masked_fill_(banned, _NEG_INF)

    # ------------------------------------------- allowed tokens, bad words, logit bias

    @staticmethod
    def _apply_token_rules(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """``allowed_token_ids``, ``bad_words_token_ids`` and ``logit_bias`` of ``rows``, in place:
        one masked fill for the allowed sets, one scatter for the banned tokens, one for the biases."""
        vocab, dev = logits.shape[1], logits.device
        allowed = [i for i in rows if requests[i].sampling_params.allowed_token_ids is not None]
        if allowed:
            keep = torch.zeros(len(allowed), vocab, dtype=torch.bool)
            for j, i in enumerate(allowed):
                keep[j, [t for t in requests[i].sampling_params.allowed_token_ids if t < vocab]] = True
            idx = torch.tensor(allowed, device=dev)
            logits[idx] = logits[idx].masked_fill_(~keep.to(dev), _NEG_INF)
        banned: list[int] = []
        biased: list[int] = []
        biases: list[float] = []
        for i in rows:
            p = requests[i].sampling_params
            output = requests[i].output_token_ids
            for word in p.bad_words_token_ids:
                *head, last = word
                if last < vocab and (not head or output[len(output) - len(head):] == head):
                    banned.append(i * vocab + last)
            for token, bias in (p.logit_bias or {}).items():
                if token < vocab:
                    biased.append(i * vocab + token)
                    biases.append(float(bias))
        flat = logits.view(-1)
        if banned:
            flat[torch.tensor(banned, dtype=torch.long, device=dev)] = _NEG_INF
        if biased:
            flat.index_add_(0, torch.tensor(biased, dtype=torch.long, device=dev),
                            torch.tensor(biases, dtype=torch.float32, device=dev))

    # -------------------------------------------------------------- penalties

    @staticmethod
    def _flat_indices(requests: list[Request], rows: list[int], attr: str, vocab: int, device) -> torch.Tensor:
        """Flat indices row * vocab + token of the tokens in ``getattr(request, attr)`` of ``rows``."""
        flat: list[int] = []
        for i in rows:
            base = i * vocab
            flat.extend(base + t for t in getattr(requests[i], attr) if 0 <= t < vocab)
        return torch.tensor(flat, dtype=torch.long, device=device)

    def _apply_penalties(
        self, logits: torch.Tensor, requests: list[Request], use_rep: bool, use_freq_pres: bool
    ) -> None:
        """In place, on the (row, token) pairs concerned only: no [batch, vocab] temporaries."""
        num, vocab = logits.shape
        dev = logits.device
        flat_logits = logits.view(-1)
        params = [r.sampling_params for r in requests]
        if use_rep:
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
            seen = torch.unique(self._flat_indices(requests, rows, "all_token_ids", vocab, dev))
            if seen.numel():
                pen = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)
                pen = pen[seen // vocab]
                vals = flat_logits[seen]
                flat_logits[seen] = torch.where(vals > 0, vals / pen, vals * pen)
        if use_freq_pres:
            rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
            out, counts = torch.unique(
                self._flat_indices(requests, rows, "output_token_ids", vocab, dev), return_counts=True
            )
            if out.numel():
                freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)
                pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)
                row = out // vocab
                flat_logits[out] -= freq[row] * counts.to(torch.float32) + pres[row]

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        vocab = logits.shape[1]
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i in rows:
            for t in requests[i].stop_token_ids():  # the tokens that would end it (Request)
                if 0 <= t < vocab:
                    row_idx.append(i)
                    tok_idx.append(t)
        if row_idx:
            dev = logits.device
            logits[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = _NEG_INF

    # ---------------------------------------------------------------- random

    def _sample_random(self, logits: torch.Tensor, requests: list[Request], private: bool) -> torch.Tensor:
        """Sample one token per row (all rows have temperature > 0).

        Every step below works row by row with the row's own parameters, so a row's result does
        not depend on the other rows. ``private``: ``logits`` may be modified in place.
        """
        num, vocab = logits.shape
        dev = logits.device
        params = [r.sampling_params for r in requests]

        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=torch.float32, device=dev)[:, None]
            private = True

        def _on_rows(x: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
            """``fn`` (which returns a new tensor) applied to the given rows of ``x``."""
            nonlocal private
            if len(rows) == num:
                private = True
                return fn(x)
            if not private:
                x, private = x.clone(), True
            idx = torch.tensor(rows, device=dev)
            return x.index_copy_(0, idx, fn(x[idx]))

        # top-k: keep the logits >= the k-th largest (ties with it are kept).
        topk_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if topk_rows:
            ks = [params[i].top_k for i in topk_rows]

            def top_k(sub: torch.Tensor) -> torch.Tensor:
                kth = sub.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)
                return sub.masked_fill(sub < kth, _NEG_INF)

            logits = _on_rows(logits, topk_rows, top_k)

        # top-p, on the distribution renormalised after top-k.
        topp_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if topp_rows:
            ps = [params[i].top_p for i in topp_rows]
            logits = _on_rows(logits, topp_rows, lambda sub: _top_p(sub, ps))

        # min-p: p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p). After top-k/top-p, which
        # keep the top token and whose renormalisation leaves ratios unchanged: the three sets intersect.
        minp_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if minp_rows:
            log_min_p = torch.tensor([math.log(params[i].min_p) for i in minp_rows], device=dev)[:, None]

            def min_p(sub: torch.Tensor) -> torch.Tensor:
                top = sub.max(dim=-1, keepdim=True).values
                return sub.masked_fill(sub - top < log_min_p, _NEG_INF)

            logits = _on_rows(logits, minp_rows, min_p)

        probs = torch.softmax(logits, dim=-1)

        # One float64 uniform per row: from the request's own generator when it has a seed.
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == num:
            u = torch.rand(num, dtype=torch.float64, device=dev, generator=self._generator)
        else:
            u = torch.empty(num, dtype=torch.float64, device=dev)
            if unseeded:
                u[torch.tensor(unseeded, device=dev)] = torch.rand(
                    len(unseeded), dtype=torch.float64, device=dev, generator=self._generator
                )
            seeded = [i for i, p in enumerate(params) if p.seed is not None]
            draws = [
                torch.rand(1, dtype=torch.float64, device=dev, generator=self._generator_for(requests[i]))
                for i in seeded
            ]
            u[torch.tensor(seeded, device=dev)] = torch.cat(draws)
        return _inverse_cdf(probs, u)

    # -------------------------------------------------------------- logprobs

    @staticmethod
    def _fill_logprobs(
        out: list[TokenLogprobs | None],
        logprobs: torch.Tensor,
        rows: list[int],
        token_ids: torch.Tensor,
        params,
    ) -> None:
        dev = logprobs.device
        toks = token_ids[torch.tensor(rows, device=dev)] if len(rows) < token_ids.shape[0] else token_ids
        for i, entry in zip(rows, token_logprobs(logprobs, toks, [params[i].logprobs for i in rows])):
            out[i] = entry
