"""The sparse MoE families (Qwen2-MoE, Mixtral, Qwen3-MoE) over the paged cache against HF
transformers on tiny random-weight models, and ``FusedMoE`` against a brute-force loop.

Tiny configs: 3 layers, 8 experts, top-2, GQA (4 query heads over 2 KV heads), hidden 64,
expert width 32. Qwen2-MoE with its gated shared expert and a dense layer (``mlp_only_layers``),
without top-k renormalisation, a window of 8 on layers 0 and 2 (HF's ``layer_types``); Mixtral
with a sliding window (8, every layer) smaller than the prompt (13);
Qwen3-MoE (per-head q/k norm, head_dim 24) with sparse and dense layers (``decoder_sparse_step``
2) and a window of 6 on every layer.

Float32: logits of a prefill and of decode steps within 1e-4 of HF's forward, on a NaN-filled
cache with out-of-order blocks, and 32 greedy tokens identical to HF ``generate``. bfloat16:
prefill logits within 0.05 of HF's bfloat16 forward. The engine end to end (chunked prefill,
prefix caching, preemption, 2 ranks): ``tests/e2e/test_moe_engine.py``; GGUF:
``tests/models/test_moe_gguf.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout, BatchInputs
from paged.core.errors import ModelLoadError
from paged.core.loading import loader
from paged.models.llama import attention_shape
from paged.models.mixtral import MixtralForCausalLM
from paged.models.moe import FusedMoE
from paged.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseBlock
from paged.models.qwen3_moe import Qwen3MoeForCausalLM

ATOL, RTOL = 1e-4, 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 40
GREEDY = 32

BASE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    num_experts_per_tok=2, tie_word_embeddings=False,
)

FAMILIES = {
    # name: (config factory, our class)
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeConfig(
            **BASE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1000000.0,
            use_sliding_window=True, sliding_window=8,
        ),  # HF's layer_types: layers 0 and 2 windowed (8), layer 1 full
        Qwen2MoeForCausalLM,
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(
            **BASE, intermediate_size=32, num_local_experts=8, rope_theta=10000.0,
            sliding_window=8,  # the prompt is 13 tokens: the window matters from the prefill on
        ),
        MixtralForCausalLM,
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **BASE, intermediate_size=96, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, head_dim=24,
            decoder_sparse_step=2, rope_theta=1000000.0, use_sliding_window=True, sliding_window=6,
        ),  # layers 1 sparse, 0 and 2 dense; head_dim 24 != 64 / 4; every layer windowed
        Qwen3MoeForCausalLM,
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that mistakes show (norms away from 1, biases away from 0); the
    routers' rows spread so the top-2 choice is not a near tie that rounding could flip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def save_tiny(name: str, path: Path) -> transformers.PreTrainedModel:
    make_config, factory = FAMILIES[name]
    config = make_config()
    config.architectures = [factory.architecture]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, seed=len(name))
    hf.eval()
    hf.save_pretrained(path)  # HF's checkpoint format: one tensor per expert
    return hf


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model in fp32 eval mode, saved directory)."""
    return {name: (save_tiny(name, p := tmp_path_factory.mktemp(name)), p) for name in FAMILIES}


# ---- a paged session (one sequence) ------------------------------------------------------------


class Session:
    """Our model + torch backend + a NaN-filled paged cache whose blocks are out of order."""

    def __init__(self, model_dir: Path, factory, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.config = loader.load_hf_config(model_dir)
        layers, heads, kv_heads, head_dim = attention_shape(self.config)
        layout = AttentionLayout(layers, heads, kv_heads, head_dim, BLOCK_SIZE, dtype, torch.device("cpu"))
        self.backend = TorchAttentionBackend(layout)
        self.model = loader.build_model(model_dir, self.config, factory, self.backend, dtype, "cpu")
        self.kv_caches = self.backend.allocate_kv_cache(NUM_BLOCKS)
        for k, v in self.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        blocks = list(range(1, NUM_BLOCKS))  # block 0 stays unused: the block table's padding value
        random.Random(seed).shuffle(blocks)
        self.blocks = blocks
        self.num_computed = 0

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of the sequence's next ``tokens``."""
        start, n = self.num_computed, len(tokens)
        slots = [self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
        used = (start + n + BLOCK_SIZE - 1) // BLOCK_SIZE
        table = torch.zeros(1, used + 1, dtype=torch.int32)
        table[0, :used] = torch.tensor(self.blocks[:used], dtype=torch.int32)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq_lens = torch.tensor([start + n], dtype=torch.int32)
        batch = BatchInputs(
            num_reqs=1, num_tokens=n, num_decodes=int(n == 1 and start > 0), max_query_len=n,
            max_seq_len=start + n, query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl.clone(),
            seq_lens_cpu=seq_lens.clone(),
        )
        positions = torch.arange(start, start + n)
        hidden = self.model(torch.tensor(tokens), positions, self.kv_caches, self.backend.build_metadata(batch))
        self.num_computed += n
        return self.model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


# ---- parity with HF ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_decode_and_greedy_match_hf(hf_models, name):
    hf, path = hf_models[name]
    session = Session(path, FAMILIES[name][1], seed=len(name))
    rng = random.Random(name)
    prompt = [rng.randrange(3, 256) for _ in range(13)]

    logits = session.step(prompt)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)
    ids = list(prompt)

    def greedy(row: torch.Tensor) -> int:  # EOS masked, as generate's min_new_tokens does
        return int(row.masked_fill(torch.arange(row.shape[-1]) == BASE["eos_token_id"], -float("inf")).argmax())

    for i in range(GREEDY - 1):
        ids.append(greedy(logits[-1]))
        logits = session.step([ids[-1]])
        if i < 4:  # a few decode steps against HF's forward; the rest through generate below
            torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=RTOL)
    ids.append(greedy(logits[-1]))

    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False, pad_token_id=0
        )[0].tolist()
    assert ids == expected
    assert len(set(ids[len(prompt):])) > 3  # not a degenerate repeat of one token


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bfloat16_prefill_logits_within_tolerance_of_hf(hf_models, name):
    """bfloat16 (weights and activations, routing in float32): the prefill's logits within 0.05
    of HF's in bfloat16 and within 0.1 of HF's float32 (logits up to ~3.5 in size; measured:
    0-0.016 and 0.02-0.036)."""
    import copy

    hf, path = hf_models[name]
    session = Session(path, FAMILIES[name][1], dtype=torch.bfloat16)
    prompt = [random.Random(name).randrange(3, 256) for _ in range(13)]
    ours = session.step(prompt)
    torch.testing.assert_close(ours, hf_logits(copy.deepcopy(hf).to(torch.bfloat16), prompt), atol=0.05, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=0.1, rtol=0)


def test_the_model_holds_experts_as_linears(hf_models):
    """Per-expert modules with HF's names (what quantization and TP slicing act on)."""
    _, path = hf_models["qwen2_moe"]
    model = Session(path, Qwen2MoeForCausalLM).model
    layers = model.model.layers
    assert isinstance(layers[0].mlp, Qwen2MoeSparseBlock) and not isinstance(layers[1].mlp, FusedMoE)
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.2.mlp.experts.7.gate_up_proj.weight" in names
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.2.mlp.shared_expert_gate.weight" in names


def test_bad_routing_config_is_refused():
    config = transformers.MixtralConfig(**{**BASE, "num_experts_per_tok": 9}, intermediate_size=32, num_local_experts=8)
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok must be an integer in \[1, num_local_experts=8\], got 9"):
        MixtralForCausalLM.check_config(config)
    config = transformers.Qwen2MoeConfig(**BASE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=0)
    with pytest.raises(ModelLoadError, match="shared_expert_intermediate_size must be a positive integer, got 0"):
        Qwen2MoeForCausalLM.check_config(config)


# ---- FusedMoE against a brute-force loop ----------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_fused_moe_equals_a_loop_over_each_tokens_experts(norm_topk_prob):
    """float64: for each token, the sum over its top-k experts (picked by softmax probability)
    of weight * down(silu(gate x) * up x), computed one token and one expert at a time from the
    modules' own parameters."""
    torch.manual_seed(0)
    hidden, experts, top_k, inter, tokens = 24, 8, 3, 10, 37
    moe = FusedMoE(hidden, experts, top_k, inter, norm_topk_prob=norm_topk_prob, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) / p.shape[-1] ** 0.5)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    with torch.no_grad():
        got = moe(x)
    want = torch.zeros_like(x)
    used = set()
    for t in range(tokens):
        probs = torch.softmax(x[t] @ moe.gate.weight.T, dim=-1)
        chosen = sorted(range(experts), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in chosen)
        for e in chosen:
            used.add(e)
            w_gu = moe.experts[e].gate_up_proj.weight
            gate, up = w_gu[:inter] @ x[t], w_gu[inter:] @ x[t]
            y = moe.experts[e].down_proj.weight @ (torch.nn.functional.silu(gate) * up)
            want[t] += (float(probs[e]) / total if norm_topk_prob else float(probs[e])) * y
    assert len(used) == experts  # every expert ran for some token
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
