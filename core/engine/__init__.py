"""The engine mechanism: requests, KV cache, scheduler, model runner, sampler, engine core, TP ranks."""
