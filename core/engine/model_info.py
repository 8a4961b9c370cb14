"""What a core tells its front-ends about its model: a plain dataclass in a module of its own, so
that a front-end (the server, ``AsyncLLM``) imports it without the engine, and so without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelInfo:
    """What a front-end needs to know about the core's model to build requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    tokenizer_dir: str = ""  # the model's own directory unless model.tokenizer names another
    runner: str = "generate"  # model.runner
    # the pooling runner: pooler, normalize (the default), max_dimensions, classifier_tokens (or None)
    pooling: dict | None = None
    # every layer's largest window (None: some layer attends to all) and the token budget:
    # what a request needs of the cache (scheduler.check_request_fits)
    sliding_window: int | None = None
    max_num_batched_tokens: int = 0
    # LoRA (lora.enable_lora): the most adapters in one step (0: LoRA is off) and the largest rank
    max_loras: int = 0
    max_lora_rank: int = 0
