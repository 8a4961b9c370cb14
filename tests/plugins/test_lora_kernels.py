"""The bundled LoRA kernels (``cpu``: C++; ``torch``: grouped matmuls) against a brute-force float64
reference that applies each row's adapter part by part, from the unpadded A and B it was made of.

The slots are laid out as ``paged.core.lora`` says (part p's rank-r rows at ``p * max_rank``, B
transposed, zeros elsewhere); a slot whose adapter leaves the layer alone has rank 0, and rows of
the base model (slot -1) must come out unchanged, bit for bit."""

from __future__ import annotations

import pytest
import torch

from paged.core.lora import LoRABatch, LoRALayerWeights
from paged.plugins.lora import CpuLoRAKernel, TorchLoRAKernel

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
KERNELS = {"cpu": CpuLoRAKernel, "torch": TorchLoRAKernel}


def make_slots(parts_out: list[int], in_features: int, ranks: list[list[int]], max_rank: int, dtype, seed: int):
    """Slots for a layer of len(parts_out) parts; ``ranks[s][p]`` = rank of slot s's adapter on part
    p (0: none). Returns the layer's weights and, per slot, the list of (A [r, in], B [out_p, r],
    first output column) in float64 to check against."""
    g = torch.Generator().manual_seed(seed)
    parts, num_slots = len(parts_out), len(ranks)
    out_features = sum(parts_out)
    a = torch.zeros(num_slots, parts * max_rank, in_features, dtype=dtype)
    b = torch.zeros(num_slots, parts * max_rank, out_features, dtype=dtype)
    adapters = []
    for s, slot_ranks in enumerate(ranks):
        pieces, col = [], 0
        for p, (rows, r) in enumerate(zip(parts_out, slot_ranks)):
            if r:
                A = (torch.randn(r, in_features, generator=g) * 0.3).to(dtype)
                B = (torch.randn(rows, r, generator=g) * 0.3).to(dtype)
                a[s, p * max_rank: p * max_rank + r] = A
                b[s, p * max_rank: p * max_rank + r, col: col + rows] = B.T
                pieces.append((A.double(), B.double(), col))
            col += rows
        adapters.append(pieces)
    weights = LoRALayerWeights(a, b, torch.tensor([max(r) for r in ranks], dtype=torch.int32), parts, "test")
    return weights, adapters


def reference(y: torch.Tensor, x: torch.Tensor, token_slots: list[int], adapters) -> torch.Tensor:
    out = y.double().clone()
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        for A, B, col in adapters[s]:
            out[t, col: col + B.shape[0]] += B @ (A @ x[t].double())
    return out


def batch_of(token_slots: list[int]) -> LoRABatch:
    slots = sorted({s for s in token_slots if s >= 0})
    ts = torch.tensor(token_slots, dtype=torch.int32)
    return LoRABatch(ts, slots, [torch.nonzero(ts == s).flatten() for s in slots])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_each_row_gets_its_own_adapter(kernel, dtype, rows):
    # a fused QKV-like layer: 3 parts of 48 / 16 / 16 outputs, 40 inputs (not a multiple of 16)
    weights, adapters = make_slots([48, 16, 16], 40, [[8, 8, 8], [4, 0, 2], [0, 0, 0]], max_rank=8, dtype=dtype,
                                   seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    y = torch.randn(rows, 80, generator=g).to(dtype)
    token_slots = [(t % 4) - 1 for t in range(rows)]  # base, slot 0, slot 1, slot 2 (leaves the layer alone)
    expected = reference(y, x, token_slots, adapters)
    before = y.clone()
    KERNELS[kernel]().apply(y, x, weights, batch_of(token_slots))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), expected, atol=atol, rtol=rtol)
    untouched = [t for t, s in enumerate(token_slots) if s < 0 or s == 2]
    assert torch.equal(y[untouched], before[untouched])  # the base rows, bit for bit


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_one_adapter_for_every_row_and_a_strided_input(kernel):
    """Every row on one slot (the torch kernel's no-gather path), and an input that is a column
    slice of a wider tensor (the C++ kernel reads rows by their stride)."""
    weights, adapters = make_slots([64], 32, [[16], [5]], max_rank=16, dtype=torch.float32, seed=7)
    wide = torch.randn(10, 48)
    x = wide[:, 8:40]
    y = torch.randn(10, 64)
    token_slots = [1] * 10
    expected = reference(y, x, token_slots, adapters)
    KERNELS[kernel]().apply(y, x, weights, batch_of(token_slots))
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_kernels_agree_with_a_row_parallel_share():
    """A row-parallel layer's rank holds A's columns of its input share: the kernels' partial sums
    over the two shares add up to the whole adapter's product (what the all-reduce computes)."""
    full, partial = make_slots([24], 32, [[6]], max_rank=8, dtype=torch.float64, seed=3)
    x = torch.randn(5, 32, dtype=torch.float64)
    token_slots = [0] * 5
    total = torch.zeros(5, 24, dtype=torch.float64)
    for cols in (slice(0, 16), slice(16, 32)):
        share = LoRALayerWeights(full.a[:, :, cols].contiguous(), full.b, full.ranks, 1)
        y = torch.zeros(5, 24, dtype=torch.float64)
        TorchLoRAKernel().apply(y, x[:, cols], share, batch_of(token_slots))
        total += y
    torch.testing.assert_close(total, reference(torch.zeros(5, 24), x, token_slots, partial), atol=1e-12, rtol=1e-12)
