"""``gpu_check.py`` section 3: decode throughput of each backend on a random Llama at growing
batch sizes and contexts, against the copy bandwidth (see gpu_check.py's docstring)."""

from __future__ import annotations

import time

from _gpu_common import Report, backend_status, header, make_backend, short_error, sync

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e


# ---- 3. throughput -------------------------------------------------------------------------------


def build_random_llama(config, dtype, device, backend):
    import torch

    from paged.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, backend, dtype, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def set_backend(model, backend) -> None:
    from paged.models.layers import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


def decode_rate(model, backend, layout, batch_size, context, warmup, steps, device):
    """Tokens/s and seconds per step of ``steps`` decode steps for ``batch_size`` requests that start
    at ``context`` tokens (the cache holds random K/V: no prefill)."""
    import numpy as np
    import torch

    from paged.core.attention import BatchInputs
    from paged.core.engine.kv_cache_manager import cdiv

    bs = layout.block_size
    total = context + warmup + steps + 1
    per_req = cdiv(total, bs)
    num_blocks = batch_size * per_req + 1
    caches = backend.allocate_kv_cache(num_blocks)
    for k, v in caches:
        k.normal_()
        v.normal_()
    table = (np.random.default_rng(0).permutation(num_blocks - 1)[: batch_size * per_req] + 1).astype(np.int32)
    table = table.reshape(batch_size, per_req)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size,), device=device)
    qsl = torch.arange(batch_size + 1, dtype=torch.int32)

    def step(seq_len):
        nonlocal input_ids
        pos = seq_len - 1
        slots = table[:, pos // bs].astype(np.int64) * bs + pos % bs
        seq = torch.full((batch_size,), seq_len, dtype=torch.int32)
        batch = BatchInputs(
            num_reqs=batch_size, num_tokens=batch_size, num_decodes=batch_size, max_query_len=1, max_seq_len=seq_len,
            query_start_loc=qsl.to(device, non_blocking=True), seq_lens=seq.to(device, non_blocking=True),
            block_table=torch.from_numpy(table[:, : cdiv(seq_len, bs)]).to(device, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )
        positions = torch.full((batch_size,), pos, dtype=torch.long, device=device)
        meta = backend.build_metadata(batch)
        hidden = model(input_ids, positions, caches, meta)
        input_ids = model.compute_logits(hidden).argmax(-1)

    with torch.inference_mode():
        seq_len = context + 1
        for _ in range(warmup):
            step(seq_len)
            seq_len += 1
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(seq_len)
            seq_len += 1
        sync(device)
        secs = (time.perf_counter() - t0) / steps
    return batch_size / secs, secs, context + warmup + steps / 2


def copy_bandwidth(device) -> float | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return bw


def section_throughput(args, report: Report, device: str, backends: list[str]) -> None:
    import torch
    from transformers import LlamaConfig

    from paged.core.attention import AttentionLayout

    dry = args.cpu_dry
    if dry:
        header("3. decode throughput (CPU dry run: tiny model, numbers not meaningful)")
        config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        dtype, batches = torch.float32, (1, 4)
        context, warmup, steps = args.context or 16, 1, args.steps or 2
    else:
        header("3. decode throughput: random-weight ~1.2B Llama, bf16, eager (no CUDA graphs)")
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                             tie_word_embeddings=False)
        dtype, batches = torch.bfloat16, (1, 32, 128)
        context, warmup, steps = args.context or 512, 3, args.steps or 20
    layers, H, Hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    layout = AttentionLayout(layers, H, Hkv, D, 16, dtype, torch.device(device))
    names = ["torch"] + [b for b in ("triton", "flashinfer") if b in backends]
    model = None
    copy_bw = copy_bandwidth(device)
    if copy_bw:
        print(f"  measured device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (H200 spec {H200_BANDWIDTH / 1e12:.1f})")
    for name in names:
        ok, reason = backend_status(name, device)
        if not ok:
            report.add(f"throughput/{name}", "SKIP", reason)
            continue
        if report.left() < 25:
            report.add(f"throughput/{name}", "SKIP", "out of time budget")
            continue
        try:
            backend = make_backend(name, layout)
            if model is None:
                model = build_random_llama(config, dtype, device, backend)
                params = sum(p.numel() for p in model.parameters())
                embed = model.model.embed_tokens.weight
                weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
                weight_bytes -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
                print(f"  model: {params / 1e9:.2f} B parameters, {weight_bytes / 1e9:.2f} GB read per step "
                      f"(all weights but the embedding table), context {context}")
            set_backend(model, backend)
            for b in batches:
                if report.left() < 10:
                    report.add(f"throughput/{name}/batch {b}", "SKIP", "out of time budget")
                    continue
                rate, secs, avg_ctx = decode_rate(model, backend, layout, b, context, warmup, steps, device)
                line = f"  {name:10} batch {b:4}: {rate:10.1f} tokens/s  ({secs * 1e3:7.2f} ms/step)"
                if b == 1:
                    kv_bytes = 2 * layers * avg_ctx * Hkv * D * torch.empty((), dtype=dtype).element_size()
                    bw = (weight_bytes + kv_bytes) / secs
                    line += f"  {bw / 1e12:.2f} TB/s = {bw / H200_BANDWIDTH:.0%} of 4.8 TB/s"
                    if copy_bw:
                        line += f", {bw / copy_bw:.0%} of measured copy"
                print(line, flush=True)
                report.results.append((f"throughput/{name}/batch {b}", "PASS", f"{rate:.1f} tok/s"))
        except Exception as e:
            report.add(f"throughput/{name}", "FAIL", short_error(e))
        finally:
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
