"""Hand-built ``BatchInputs`` for the attention-backend tests: the block table, slot mapping and
query/sequence offsets computed directly from per-request block lists, independently of the
model runner."""

from __future__ import annotations

import torch

from paged.core.attention import BatchInputs


def make_batch(block_tables, computed_lens, query_lens, block_size, device="cpu", num_decodes=None, pad_cols=2):
    """BatchInputs for requests that have ``computed_lens[i]`` tokens cached and schedule
    ``query_lens[i]`` new ones; ``block_tables[i]`` lists the request's block ids. Decodes
    (the leading requests with one new token after a cached context) come first."""
    num_reqs = len(block_tables)
    seq_lens = [c + q for c, q in zip(computed_lens, query_lens)]
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1 and computed_lens[num_decodes] > 0:
            num_decodes += 1
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    table = torch.zeros(num_reqs, max(len(b) for b in block_tables) + pad_cols, dtype=torch.int32)
    slots = []
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(computed_lens[i], seq_lens[i])]
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return BatchInputs(
        num_reqs=num_reqs,
        num_tokens=query_start_loc[-1],
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device),
        seq_lens=sl.to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=sl,
    )
