"""Helpers shared by ``gpu_check.py`` and its sections: the report, printing, backends and
batches built the same way in every section."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

# ---- bookkeeping --------------------------------------------------------------------------------


@dataclass
class Report:
    deadline: float
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (check, PASS|FAIL|SKIP, detail)

    def add(self, check: str, status: str, detail: str = "") -> None:
        self.results.append((check, status, detail))
        print(f"  [{status}] {check}" + (f": {detail}" if detail else ""), flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def summary(self) -> int:
        print("\n== summary ==")
        for status in ("FAIL", "SKIP", "PASS"):
            items = [(c, d) for c, s, d in self.results if s == status]
            print(f"{status}: {len(items)}")
            if status != "PASS":
                for c, d in items:
                    print(f"  {c}: {d}")
        if any(s == "FAIL" for _, s, _ in self.results):
            return 1
        if not any(s == "PASS" for _, s, _ in self.results):
            print("nothing was checked (every section skipped): exit status 2")
            return 2  # a run that checked nothing must not read as a pass
        return 0


def header(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def short_error(e: BaseException) -> str:
    lines = [line for line in traceback.format_exception_only(type(e), e) if line.strip()]
    return " ".join(lines[-1].split())[:400]


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_backend(name: str, layout, options=None):
    if name == "torch":
        from paged.backends.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend(layout)
    if name == "triton":
        from paged.backends.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(layout, options)
    if name == "flashinfer":
        from paged.backends.flashinfer_attention import FlashInferAttentionBackend

        return FlashInferAttentionBackend(layout, options)
    raise ValueError(name)


def backend_status(name: str, device: str) -> tuple[bool, str]:
    from paged.backends import flashinfer_attention, triton_attention

    if name == "triton":
        return triton_attention.is_available(device)
    if name == "flashinfer":
        return flashinfer_attention.is_available(device)
    return True, ""


def make_batch(block_tables, computed, new, block_size, device):
    """BatchInputs for requests with ``computed[i]`` cached and ``new[i]`` new tokens (decodes first)."""
    import numpy as np
    import torch

    from paged.core.attention import BatchInputs

    n = len(block_tables)
    seq = [c + q for c, q in zip(computed, new)]
    nd = 0
    while nd < n and new[nd] == 1 and computed[nd] > 0:
        nd += 1
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    width = max(len(b) for b in block_tables)
    table = np.zeros((n, width), dtype=np.int32)
    slots = []
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
        pos = np.arange(computed[i], seq[i])
        slots.append(np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
    qsl_t, seq_t = torch.from_numpy(qsl), torch.tensor(seq, dtype=torch.int32)
    return BatchInputs(
        num_reqs=n, num_tokens=int(qsl[-1]), num_decodes=nd, max_query_len=max(new), max_seq_len=max(seq),
        query_start_loc=qsl_t.to(device), seq_lens=seq_t.to(device), block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device), query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t,
    )
