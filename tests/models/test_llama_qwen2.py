"""Llama / Qwen2 over the paged cache against HF transformers, on tiny random-weight models.

Each tiny model is saved with ``save_pretrained`` (one of them sharded, to go through the index),
loaded by ``paged.core.loading.loader`` and run with the torch attention backend on a paged cache whose
blocks are deliberately out of order. The logits of a prefill and of several decode steps (greedy
tokens fed back) must match HF's forward in fp32, and the greedy ids HF ``generate``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout, BatchInputs
from paged.core.errors import ConfigError, ModelLoadError
from paged.core.registry import load_plugins
from paged.core.loading import loader
from paged.models.layers import RotaryEmbedding, compute_inv_freq
from paged.models.llama import LlamaForCausalLM, attention_shape
from paged.models.qwen2 import Qwen2ForCausalLM

ATOL, RTOL = 1e-4, 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 32

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so that the scaling changes short contexts
}

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

VARIANTS = {
    # name: (config factory, save_pretrained kwargs)
    "llama3-tied": (
        lambda: transformers.LlamaConfig(
            **BASE, num_hidden_layers=3, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True
        ),
        {},
    ),
    "llama-untied-sharded": (
        lambda: transformers.LlamaConfig(
            **BASE, num_hidden_layers=2, head_dim=32, rope_theta=10000.0, tie_word_embeddings=False
        ),
        {"max_shard_size": "100KB"},
    ),
    "qwen2": (
        lambda: transformers.Qwen2Config(**BASE, num_hidden_layers=2, rope_theta=1000000.0, tie_word_embeddings=False),
        {},
    ),
    "qwen2-tied": (
        lambda: transformers.Qwen2Config(**BASE, num_hidden_layers=2, tie_word_embeddings=True),
        {},
    ),
}


# ---- tiny HF models --------------------------------------------------------------------------


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that mistakes show in the logits; norms away from 1 and biases away
    from 0 (HF initialises them to 1 and 0, which would hide a swapped norm or a lost bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model in fp32 eval mode, saved directory)."""
    out = {}
    for i, (name, (make_config, save_kwargs)) in enumerate(VARIANTS.items()):
        config = make_config()
        config.architectures = ["Qwen2ForCausalLM" if config.model_type == "qwen2" else "LlamaForCausalLM"]
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(hf, seed=100 + i)
        hf.eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, **save_kwargs)
        out[name] = (hf, path)
    return out


# ---- a paged session for one or more sequences ----------------------------------------------


class Seq:
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.num_computed = 0

    def slot(self, position: int) -> int:
        return self.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def make_batch(items: list[tuple[Seq, list[int]]]) -> tuple[BatchInputs, torch.Tensor, torch.Tensor]:
    """``items``: (sequence, its new tokens) in batch order, decodes first. Returns the batch,
    input_ids and positions; advances each sequence's ``num_computed``."""
    input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    num_decodes = 0
    for i, (seq, tokens) in enumerate(items):
        if len(tokens) == 1 and seq.num_computed > 0 and num_decodes == i:
            num_decodes += 1
        for j, tok in enumerate(tokens):
            pos = seq.num_computed + j
            input_ids.append(tok)
            positions.append(pos)
            slots.append(seq.slot(pos))
        qsl.append(qsl[-1] + len(tokens))
        seq_lens.append(seq.num_computed + len(tokens))
    width = max(len(seq.block_ids) for seq, _ in items) + 1
    table = torch.zeros(len(items), width, dtype=torch.int32)
    for i, (seq, _) in enumerate(items):
        table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        seq.num_computed += len(items[i][1])
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32)
    batch = BatchInputs(
        num_reqs=len(items),
        num_tokens=len(input_ids),
        num_decodes=num_decodes,
        max_query_len=max(len(t) for _, t in items),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl_t,
        seq_lens=sl_t,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl_t.clone(),
        seq_lens_cpu=sl_t.clone(),
    )
    return batch, torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long)


class Session:
    """Our model + torch backend + a NaN-filled paged cache (a read of an unwritten slot shows)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.config = loader.load_hf_config(model_dir)
        arch = loader.model_architecture(self.config)
        factory = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM}[arch]
        layers, heads, kv_heads, head_dim = attention_shape(self.config)
        layout = AttentionLayout(layers, heads, kv_heads, head_dim, BLOCK_SIZE, dtype, torch.device("cpu"))
        self.backend = TorchAttentionBackend(layout)
        self.model = loader.build_model(model_dir, self.config, factory, self.backend, dtype, "cpu")
        self.kv_caches = self.backend.allocate_kv_cache(NUM_BLOCKS)
        for k, v in self.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))

    @torch.inference_mode()
    def step(self, items: list[tuple[Seq, list[int]]], all_logits: bool = False) -> torch.Tensor:
        batch, input_ids, positions = make_batch(items)
        metadata = self.backend.build_metadata(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        assert hidden.shape == (batch.num_tokens, self.config.hidden_size)
        if not all_logits:
            hidden = hidden[batch.query_start_loc_cpu[1:].long() - 1]
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return logits


def shuffled_blocks(n: int, seed: int) -> list[int]:
    blocks = list(range(1, NUM_BLOCKS))  # block 0 stays unused: the block table's padding value
    random.Random(seed).shuffle(blocks)
    return blocks[:n]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


# ---- parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_and_decode_match_hf(hf_models, name):
    hf, path = hf_models[name]
    session = Session(path)
    rng = random.Random(name)
    prompt = [rng.randrange(3, 256) for _ in range(13)]
    seq = Seq(shuffled_blocks(8, seed=len(name)))

    logits = session.step([(seq, prompt)], all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)

    ids = list(prompt)
    for _ in range(6):
        ids.append(int(logits[-1].argmax()))
        logits = session.step([(seq, [ids[-1]])])
        torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=RTOL)
    ids.append(int(logits[-1].argmax()))

    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=7, do_sample=False, min_new_tokens=7, pad_token_id=0
        )[0].tolist()
    assert ids == expected


def test_chunked_prefill_and_mixed_batch_match_hf(hf_models):
    """Two sequences in one step: A's prefill in two chunks (the second after a cached prefix)
    alongside B's whole prefill, then both decoding together."""
    hf, path = hf_models["llama3-tied"]
    session = Session(path)
    rng = random.Random(7)
    prompt_a = [rng.randrange(3, 256) for _ in range(11)]
    prompt_b = [rng.randrange(3, 256) for _ in range(6)]
    blocks = shuffled_blocks(10, seed=3)
    a, b = Seq(blocks[:5]), Seq(blocks[5:])

    session.step([(a, prompt_a[:5])])
    logits = session.step([(a, prompt_a[5:]), (b, prompt_b)], all_logits=True)
    torch.testing.assert_close(logits[:6], hf_logits(hf, prompt_a)[5:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[6:], hf_logits(hf, prompt_b), atol=ATOL, rtol=RTOL)

    ids_a, ids_b = list(prompt_a), list(prompt_b)
    last_a, last_b = logits[5], logits[-1]
    for _ in range(4):
        ids_a.append(int(last_a.argmax()))
        ids_b.append(int(last_b.argmax()))
        last_a, last_b = session.step([(a, [ids_a[-1]]), (b, [ids_b[-1]])])
        torch.testing.assert_close(last_a, hf_logits(hf, ids_a)[-1], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(last_b, hf_logits(hf, ids_b)[-1], atol=ATOL, rtol=RTOL)


def test_bfloat16_runs_close_to_float32(hf_models):
    _, path = hf_models["qwen2"]
    prompt = list(range(10, 30))
    ref = Session(path).step([(Seq([1, 2, 3, 4, 5]), prompt)])
    session = Session(path, dtype=torch.bfloat16)
    assert session.model.model.embed_tokens.weight.dtype == torch.bfloat16
    got = session.step([(Seq([1, 2, 3, 4, 5]), prompt)])
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("name", ["qwen2", "llama3-tied", "llama-untied-sharded"])
def test_bfloat16_packed_cpu_weights_give_the_same_logits(hf_models, name):
    from paged.models.layers import Linear, prepack_cpu_linears

    _, path = hf_models[name]
    prompt = list(range(10, 30))
    plain = Session(path, dtype=torch.bfloat16)
    ref = plain.step([(Seq([1, 2, 3, 4, 5]), prompt)])
    packed = Session(path, dtype=torch.bfloat16)
    num_linears = sum(isinstance(m, Linear) for m in packed.model.modules())
    assert prepack_cpu_linears(packed.model) == num_linears + 1  # and the LM head
    attn = packed.model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.numel() == 0  # the dense copy is released...
    assert packed.model.model.embed_tokens.weight.numel() > 0  # ...but not a weight the embedding uses
    got = packed.step([(Seq([1, 2, 3, 4, 5]), prompt)])
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_rotary_llama3_matches_hf():
    config = transformers.LlamaConfig(**BASE, num_hidden_layers=1, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    torch.testing.assert_close(compute_inv_freq(16, 500000.0, LLAMA3_SCALING), hf_rotary.inv_freq, atol=0, rtol=1e-6)
    ours = RotaryEmbedding(16, 128, 500000.0, LLAMA3_SCALING)
    positions = torch.tensor([0, 5, 17, 100])
    cos, sin = hf_rotary(torch.zeros(1), positions[None])
    torch.testing.assert_close(ours.cos[positions], cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin[positions], sin[0, :, :8], atol=1e-6, rtol=0)


# ---- loader, config ----------------------------------------------------------------------------


def test_sharded_checkpoint_goes_through_the_index(hf_models):
    _, path = hf_models["llama-untied-sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    names = [name for name, _ in loader.iter_safetensors(path)]
    assert sorted(names) == sorted(index["weight_map"])


def test_attention_shape_and_dtype(hf_models):
    cfg = loader.load_hf_config(hf_models["llama-untied-sharded"][1])
    assert attention_shape(cfg) == (2, 4, 2, 32)  # head_dim from the config, not 64 // 4
    cfg = loader.load_hf_config(hf_models["qwen2"][1])
    assert attention_shape(cfg) == (2, 4, 2, 16)
    native_bf16 = loader.cpu_has_native_bf16()
    assert loader.get_dtype("auto", cfg, "cpu") == (torch.bfloat16 if native_bf16 else torch.float32)
    assert loader.get_dtype("bfloat16", cfg, "cpu") == torch.bfloat16
    cfg.dtype = torch.float16
    assert loader.get_dtype("auto", cfg, "cuda") == torch.float16
    with pytest.raises(ConfigError, match="float64"):
        loader.get_dtype("float64", cfg, "cpu")


def test_plugin_registers_both_architectures():
    import paged.plugins.models as plugin

    registry = load_plugins(entry_points=[], modules=[("models", plugin)], allow=None, deny=set())
    assert registry.model("LlamaForCausalLM").factory is LlamaForCausalLM
    assert registry.model("Qwen2ForCausalLM").factory is Qwen2ForCausalLM
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        registry.model("NoSuchForCausalLM")


# ---- errors ------------------------------------------------------------------------------------


def test_resolve_model_dir_errors(tmp_path, hf_models):
    with pytest.raises(ModelLoadError, match="does not exist"):
        loader.resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        loader.resolve_model_dir(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        loader.resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="pickle"):
        list(loader.iter_safetensors(tmp_path))
    path = hf_models["qwen2"][1]
    assert loader.resolve_model_dir(str(path)) == path


def test_load_hf_config_error_names_the_model_type(tmp_path):
    # Without `architectures` nothing could build it: an error naming what the file says.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    with pytest.raises(ModelLoadError, match="nonesuch"):
        loader.load_hf_config(tmp_path)
    # With one, a model type transformers does not know loads as a plain config (a plugin model).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch", "architectures": ["NoneSuchForLM"]}))
    assert loader.load_hf_config(tmp_path).architectures == ["NoneSuchForLM"]


def _model_and_weights(hf_models, name):
    hf, path = hf_models[name]
    config = loader.load_hf_config(path)
    cls = Qwen2ForCausalLM if "qwen" in name else LlamaForCausalLM
    layout_args = attention_shape(config)
    backend = TorchAttentionBackend(AttentionLayout(*layout_args, BLOCK_SIZE, torch.float32, torch.device("cpu")))
    return cls(config, backend, torch.float32, "cpu"), dict(loader.iter_safetensors(path))


def test_missing_unexpected_and_mismatched_tensors_are_named(hf_models):
    model, weights = _model_and_weights(hf_models, "qwen2")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    del weights["lm_head.weight"]
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    weights["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    with pytest.raises(ModelLoadError) as e:
        model.load_weights(weights.items())
    msg = str(e.value)
    assert "missing tensors (2)" in msg
    assert "model.layers.1.self_attn.k_proj.bias" in msg and "lm_head.weight" in msg
    assert "unexpected tensors (1): model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.0.mlp.down_proj.weight" in msg and "(64, 100)" in msg and "(64, 112)" in msg


def test_ignored_tensors(hf_models):
    """rotary_emb.inv_freq is ignored; so is an lm_head.weight when the embeddings are tied."""
    model, weights = _model_and_weights(hf_models, "llama3-tied")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    weights["lm_head.weight"] = torch.zeros(256, 64)
    model.load_weights(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_unknown_rope_type_is_a_clear_error():
    unknown = {"rope_type": "nonesuch", "factor": 2.0}
    config = transformers.LlamaConfig(**BASE, num_hidden_layers=1, rope_scaling=unknown)
    backend = TorchAttentionBackend(AttentionLayout(1, 4, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu")))
    with pytest.raises(ModelLoadError, match="rope_type 'nonesuch' is not supported.*yarn, longrope"):
        LlamaForCausalLM(config, backend, torch.float32, "cpu")
