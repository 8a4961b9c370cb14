"""Qwen3, Mistral and Phi-3 over the paged cache against HF transformers, on tiny random weights.

Each tiny model (3 layers, GQA 4 query heads / 2 KV heads, hidden 64) is saved with
``save_pretrained`` (with a small byte-level tokenizer) and loaded by ``paged.core.loading.loader``,
then run with the torch backend on a NaN-filled paged cache whose blocks are out of order. What
each variant exercises: Qwen3's q/k norms with a head_dim that is not hidden / heads, and with
sliding layers, q/k/v biases and yarn scaling; Mistral's explicit head_dim and a window shorter
than the prompt; Phi-3's fused projections with partial rotary and longrope (its pretraining
context of 32 is crossed while decoding, so the long factors take over), and a window.

References: HF's eager float32 forward for a prefill (and chunked prefill), HF ``generate``'s
per-step logits and greedy tokens for 32 decode steps (HF's incremental generation is what
longrope's short/long switch is defined by), within ``ATOL``/``RTOL``; the same tokens through
``paged.LLM`` (chunked prefill, prefix caching) and from a GGUF of the same weights written with
the ``gguf`` package (llama.cpp's names and keys written out below).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers

from helpers.batch import make_batch
from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout
from paged.core.errors import ConfigError, ModelLoadError
from paged.core.loading import loader
from paged.models.mistral import MistralForCausalLM
from paged.models.phi3 import Phi3ForCausalLM
from paged.models.qwen3 import QKNormAttention, Qwen3ForCausalLM

ATOL, RTOL = 1e-4, 1e-4  # float32 against HF's float32 (the same ops, other summation orders)
BLOCK_SIZE = 4
NUM_BLOCKS = 40
NEW_TOKENS = 32
WINDOW = 6  # shorter than every prompt: the windowed layers' window matters

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad 0, bos 1, eos 2
MERGES = ["Ġ t", "h e", "Ġt he"]
VOCAB = len(SPECIALS) + 256 + len(MERGES)  # 262
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, attn_implementation="eager")


PHI3_ORIGINAL = 32  # longrope's pretraining context: prompt + 32 new tokens cross it


def _phi3_longrope(rotary_dim: int, original: int = PHI3_ORIGINAL) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.4 * i for i in range(half)], "original_max_position_embeddings": original}


VARIANTS = {
    # name: (config factory, architecture)
    "qwen3": (lambda: transformers.Qwen3Config(**BASE, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True),
              "Qwen3ForCausalLM"),
    "qwen3-sliding-bias-yarn": (lambda: transformers.Qwen3Config(
        **BASE, head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=False), "Qwen3ForCausalLM"),
    "mistral-window": (lambda: transformers.MistralConfig(
        **BASE, head_dim=32, sliding_window=WINDOW, rope_theta=10000.0, tie_word_embeddings=False),
        "MistralForCausalLM"),
    "phi3-partial-longrope": (lambda: transformers.Phi3Config(
        **BASE, partial_rotary_factor=0.5, original_max_position_embeddings=PHI3_ORIGINAL, rope_scaling=_phi3_longrope(8),
        sliding_window=None, tie_word_embeddings=False), "Phi3ForCausalLM"),
    "phi3-window-tied": (lambda: transformers.Phi3Config(
        **BASE, sliding_window=WINDOW + 1, rope_theta=10000.0, tie_word_embeddings=True), "Phi3ForCausalLM"),
}


# ---- tiny HF models ----------------------------------------------------------------------------


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that mistakes show: norms away from 1 (a lost q/k norm shows),
    biases away from 0, unit-variance embeddings, 1/sqrt(fan-in) projections."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)  # a tied head must not echo the input


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE over ``VOCAB`` ids: the 3 specials, the 256 byte symbols, 3 merges (the
    same vocabulary the GGUFs below carry)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(SPECIALS + symbols + [m.replace(" ", "") for m in MERGES])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                                eos_token=SPECIALS[2])
    fast.chat_template = TEMPLATE
    assert len(fast) == VOCAB
    return fast


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model, float32 eval, saved directory with the tokenizer)."""
    out = {}
    for i, (name, (make_config, arch)) in enumerate(VARIANTS.items()):
        config = make_config()
        config.architectures = [arch]
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(hf, seed=300 + i)
        hf.eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        tokenizer().save_pretrained(path)
        out[name] = (hf, path)
    return out


def hf_generate(hf, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy ``n`` tokens (EOS an ordinary token, as ``ignore_eos``) and the logits of
    each step, computed incrementally over HF's own cache."""
    config = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                                           output_logits=True, return_dict_in_generate=True)
    model_eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None  # else generate merges it in
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), generation_config=config)
    finally:
        hf.generation_config.eos_token_id = model_eos
    assert out.sequences.shape[1] == len(prompt) + n
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


@torch.no_grad()
def hf_incremental(hf, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """HF's model run token by token over its own cache, greedy, without ``generate``: what
    Phi-3's longrope computes when each position keeps the factors it was encoded with
    (``generate`` instead re-encodes the whole sequence with the long factors when it first
    grows past ``original_max_position_embeddings``; paged keeps the cached keys, see
    ``paged.models.rotary.rope_angles``)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    logits, ids = [out.logits[0, -1].float()], []
    for _ in range(n):
        ids.append(int(logits[-1].argmax()))
        if len(ids) < n:
            out = hf(torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return ids, logits


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


# ---- a paged session ---------------------------------------------------------------------------


class Seq:
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.num_computed = 0


class Session:
    """Our model + torch backend + a NaN-filled paged cache (a read of an unwritten slot shows)."""

    def __init__(self, model_dir, dtype: torch.dtype = torch.float32) -> None:
        self.config = loader.load_hf_config(model_dir)
        factory = _registered(loader.model_architecture(self.config))
        layout = AttentionLayout(*factory.attention_shape(self.config), BLOCK_SIZE, dtype, torch.device("cpu"))
        self.backend = TorchAttentionBackend(layout)
        self.model = loader.build_model(model_dir, self.config, factory, self.backend, dtype, "cpu")
        self.kv_caches = self.backend.allocate_kv_cache(NUM_BLOCKS)
        for k, v in self.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))

    @torch.inference_mode()
    def step(self, items: list[tuple[Seq, list[int]]], all_logits: bool = False) -> torch.Tensor:
        batch = make_batch(
            [s.block_ids for s, _ in items], [s.num_computed for s, _ in items], [len(t) for _, t in items], BLOCK_SIZE
        )
        input_ids = torch.tensor([t for _, toks in items for t in toks])
        positions = torch.tensor([s.num_computed + j for s, toks in items for j in range(len(toks))])
        for s, toks in items:
            s.num_computed += len(toks)
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend.build_metadata(batch))
        if not all_logits:
            hidden = hidden[batch.query_start_loc_cpu[1:].long() - 1]
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return logits

    def greedy(self, seq: Seq, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
        """Prefill ``prompt`` then ``n`` greedy steps: the tokens and each step's logits."""
        logits = [self.step([(seq, prompt)])[0]]
        ids = []
        for _ in range(n):
            ids.append(int(logits[-1].argmax()))
            if len(ids) < n:
                logits.append(self.step([(seq, [ids[-1]])])[0])
        return ids, logits


def _registered(architecture: str):
    """The factory the bundled models plugin registers for ``architecture``."""
    from paged.plugins.models import register_models

    return {spec.architecture: spec.factory for spec in register_models()}[architecture]


def shuffled_blocks(n: int, seed: int) -> list[int]:
    blocks = list(range(1, NUM_BLOCKS))  # block 0 stays unused: the block table's padding value
    random.Random(seed).shuffle(blocks)
    return blocks[:n]


def _prompt(seed, n: int = 13) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ---- parity ------------------------------------------------------------------------------------


def test_the_configs_exercise_what_they_claim(hf_models):
    windows = {name: [layer.self_attn.attn_settings.sliding_window for layer in Session(path).model.model.layers]
               for name, (_, path) in hf_models.items()}
    assert windows == {"qwen3": [None] * 3, "qwen3-sliding-bias-yarn": [None, WINDOW, WINDOW],
                       "mistral-window": [WINDOW] * 3, "phi3-partial-longrope": [None] * 3,
                       "phi3-window-tied": [WINDOW + 1] * 3}
    qwen3 = Session(hf_models["qwen3"][1]).model
    attn = qwen3.model.layers[0].self_attn
    assert isinstance(attn, QKNormAttention) and attn.q_norm.weight.shape == (32,) and attn.qkv_proj.bias is None
    assert attn.q_size == 4 * 32 != qwen3.config.hidden_size  # head_dim from the config, not 64 // 4
    assert Session(hf_models["qwen3-sliding-bias-yarn"][1]).model.model.layers[0].self_attn.qkv_proj.bias is not None
    phi3 = Session(hf_models["phi3-partial-longrope"][1]).model
    assert phi3.model.rotary_emb.rotary_dim == 8 and phi3.model.rotary_emb.head_dim == 16
    # the HF checkpoints really are fused
    hf_names = dict(hf_models["phi3-partial-longrope"][0].named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf_names and "model.layers.0.mlp.gate_up_proj.weight" in hf_names


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_and_32_decode_steps_match_hf(hf_models, name):
    hf, path = hf_models[name]
    session = Session(path)
    prompt = _prompt(name)
    seq = Seq(shuffled_blocks(12, seed=len(name)))

    prefill = session.step([(seq, prompt)], all_logits=True)
    torch.testing.assert_close(prefill, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)

    seq = Seq(shuffled_blocks(12, seed=len(name) + 1))
    ours, our_logits = session.greedy(seq, prompt)
    want, want_logits = hf_generate(hf, prompt)
    steps = NEW_TOKENS
    if "longrope" in name:  # generate re-encodes at the crossing: up to it, generate; all steps: HF's own cache
        steps = PHI3_ORIGINAL - len(prompt)  # the step whose token is the first past the pretraining context
        assert ours[:steps] == want[:steps]
        generated, generated_logits = want, want_logits
        want, want_logits = hf_incremental(hf, prompt)
        assert want[steps:] != generated[steps:]  # the crossing really is in the 32 steps, and matters
    for step, (got, expected) in enumerate(zip(our_logits, want_logits, strict=True)):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"step {step}: {m}")
    if "longrope" in name:
        for got, expected in zip(our_logits[:steps + 1], generated_logits[:steps + 1], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert ours == want
    assert len(set(ours)) > 3  # not a degenerate repeat of one token


@pytest.mark.parametrize("name", ["qwen3-sliding-bias-yarn", "mistral-window", "phi3-window-tied"])
def test_chunked_prefill_and_mixed_batch_match_hf(hf_models, name):
    """Two sequences in one step: A's prefill in two chunks (the second after a cached prefix
    longer than the window) alongside B's whole prefill, then both decoding together."""
    hf, path = hf_models[name]
    session = Session(path)
    prompt_a, prompt_b = _prompt(7, 17), _prompt(8, 9)
    blocks = shuffled_blocks(14, seed=3)
    a, b = Seq(blocks[:7]), Seq(blocks[7:])

    session.step([(a, prompt_a[:8])])
    logits = session.step([(a, prompt_a[8:]), (b, prompt_b)], all_logits=True)
    torch.testing.assert_close(logits[:9], hf_logits(hf, prompt_a)[8:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[9:], hf_logits(hf, prompt_b), atol=ATOL, rtol=RTOL)

    ids_a, ids_b = list(prompt_a), list(prompt_b)
    last_a, last_b = logits[8], logits[-1]
    for _ in range(5):
        ids_a.append(int(last_a.argmax()))
        ids_b.append(int(last_b.argmax()))
        last_a, last_b = session.step([(a, [ids_a[-1]]), (b, [ids_b[-1]])])
        torch.testing.assert_close(last_a, hf_logits(hf, ids_a)[-1], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(last_b, hf_logits(hf, ids_b)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["qwen3", "phi3-partial-longrope", "mistral-window"])
def test_bfloat16_close_to_float32_and_packed_weights_agree(hf_models, name):
    """bfloat16 logits within 5% of the float32 logits' range (8 bits of mantissa through 3
    layers); oneDNN-packed bfloat16 weights give the plain bfloat16 logits within 1e-2."""
    from paged.models.layers import prepack_cpu_linears

    _, path = hf_models[name]
    prompt = _prompt(name, 20)
    ref = Session(path).step([(Seq([1, 2, 3, 4, 5]), prompt)], all_logits=True)
    plain = Session(path, dtype=torch.bfloat16)
    assert plain.model.model.embed_tokens.weight.dtype == torch.bfloat16
    got = plain.step([(Seq([1, 2, 3, 4, 5]), prompt)], all_logits=True)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.05 * (ref.max() - ref.min())
    packed = Session(path, dtype=torch.bfloat16)
    assert prepack_cpu_linears(packed.model) > 0
    got_packed = packed.step([(Seq([1, 2, 3, 4, 5]), prompt)], all_logits=True)
    torch.testing.assert_close(got_packed, got, atol=1e-2, rtol=1e-2)


# ---- loading and errors ------------------------------------------------------------------------


def test_phi3_fused_checkpoint_and_split_checkpoint_load_the_same(hf_models):
    """The fused tensors are split into the parts Llama's layers declare (``split_fused_rows``):
    a checkpoint stored as the parts (what a converted Phi-3 GGUF holds) loads identically."""
    from paged.core.loading.weights import split_fused_rows

    _, path = hf_models["phi3-partial-longrope"]
    fused = Session(path).model
    weights = dict(loader.iter_safetensors(path))
    parts = dict(split_fused_rows(weights.items(), fused.fused_parts()))
    assert "model.layers.2.mlp.gate_proj.weight" in parts and "model.layers.0.self_attn.qkv_proj.weight" not in parts
    torch.testing.assert_close(parts["model.layers.1.self_attn.k_proj.weight"],
                               weights["model.layers.1.self_attn.qkv_proj.weight"][64:96], atol=0, rtol=0)
    torch.testing.assert_close(parts["model.layers.1.mlp.up_proj.weight"],
                               weights["model.layers.1.mlp.gate_up_proj.weight"][112:], atol=0, rtol=0)
    split = Phi3ForCausalLM(fused.config, Session(path).backend, torch.float32, "cpu")
    split.load_weights(parts.items())
    for (n1, p1), (n2, p2) in zip(fused.named_parameters(), split.named_parameters(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, atol=0, rtol=0)
    bad = dict(weights)
    bad["model.layers.0.self_attn.qkv_proj.weight"] = bad["model.layers.0.self_attn.qkv_proj.weight"][:100]
    with pytest.raises(ModelLoadError, match=r"qkv_proj.*\(100, 64\).*128 rows \(q_proj 64 \+ k_proj 32"):
        split.load_weights(bad.items())


def test_bad_configs_are_named(hf_models):
    backend = TorchAttentionBackend(AttentionLayout(3, 4, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu")))
    bad_types = transformers.Qwen3Config(**BASE, head_dim=16)
    bad_types.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ModelLoadError, match=r"layer_types\[1\]: 'chunked_attention' is not supported"):
        Qwen3ForCausalLM(bad_types, backend, torch.float32, "cpu")
    biased = transformers.Phi3Config(**BASE)
    biased.attention_bias = True
    with pytest.raises(ModelLoadError, match="attention_bias=true is not supported"):
        Phi3ForCausalLM(biased, backend, torch.float32, "cpu")
    gelu = transformers.MistralConfig(**BASE, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        MistralForCausalLM(gelu, backend, torch.float32, "cpu")

    class NoWindows:  # a backend written before the per-layer settings
        name = "no-windows"

    windowed = transformers.MistralConfig(**BASE, head_dim=16, sliding_window=WINDOW)
    with pytest.raises(ConfigError, match=f"'no-windows' does not support sliding_window={WINDOW}"):
        MistralForCausalLM(windowed, NoWindows(), torch.float32, "cpu")
    # a window no shorter than max_position_embeddings cannot matter: any backend runs it
    long_window = transformers.MistralConfig(**BASE, head_dim=16, sliding_window=128)
    model = MistralForCausalLM(long_window, NoWindows(), torch.float32, "cpu")
    assert model.model.layers[0].self_attn.attn_settings.sliding_window is None


def test_plugin_registers_the_three_architectures():
    from paged.core.registry import load_plugins
    import paged.plugins.models as plugin

    registry = load_plugins(entry_points=[], modules=[("models", plugin)], allow=None, deny=set())
    assert registry.model("Qwen3ForCausalLM").factory is Qwen3ForCausalLM
    assert registry.model("MistralForCausalLM").factory is MistralForCausalLM
    assert registry.model("Phi3ForCausalLM").factory is Phi3ForCausalLM


# ---- the engine --------------------------------------------------------------------------------


def test_llm_chunked_prefill_and_prefix_caching_give_hf_tokens(hf_models):
    """``paged.LLM`` on Qwen3 (windows, q/k norms, yarn) and Phi-3 (fused checkpoint, partial
    rotary, longrope crossing its pretraining context while decoding): prompts sharing a
    12-token prefix (cached by a first request), 8-token chunks, too few blocks for all three
    (preemption by recompute), greedy tokens identical to HF
    generate (longrope: to HF over its own cache, see ``hf_incremental``). Mistral is Llama's
    decoder with Qwen3's windows: the parity tests above cover it."""
    from paged import LLM, SamplingParams

    shared = _prompt("shared", 12)
    prompts = [shared + _prompt(n, n) for n in (3, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for name in ("qwen3-sliding-bias-yarn", "phi3-partial-longrope"):
        hf, path = hf_models[name]
        reference = hf_incremental if "longrope" in name else hf_generate
        expected = [reference(hf, p)[0] for p in prompts]
        llm = LLM(str(path), device="cpu", dtype="float32", attention="torch", block_size=4, num_kv_blocks=24,
                  max_num_batched_tokens=8, long_prefill_token_threshold=8, enable_prefix_caching=True)
        try:
            llm.generate([shared + [7]], params, use_tqdm=False)  # the shared prefix, cached
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == expected, name
            assert sum(o.metrics.num_cached_tokens for o in outs) >= 8, name  # the shared prefix's full blocks
            assert sum(o.metrics.num_preemptions for o in outs) > 0, name  # 24 blocks hold two of the three
        finally:
            llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "phi3-partial-longrope"])
def test_two_tensor_parallel_ranks_match_one(hf_models, name):
    """TP=2 (gloo on the CPU): each rank holds 2 query heads and 1 KV head (its q/k/v rows
    cut out of Phi-3's fused qkv_proj), half the MLP and of the vocabulary; Qwen3's q/k norms
    are replicated. Tokens identical to TP=1, logprobs within 1e-4."""
    from paged import LLM, SamplingParams

    _, path = hf_models[name]
    prompts = [_prompt(1, 9), _prompt(2, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=12,
                    long_prefill_token_threshold=5)
    results = {}
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, **settings) as llm:
            heads = llm.engine.core.runner.layout.num_heads
            outputs = llm.generate(prompts, params, use_tqdm=False)
        results[size] = (heads, [o.outputs[0].token_ids for o in outputs],
                         [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs])
    assert results[2][0] == 2 and results[1][0] == 4
    assert results[2][1] == results[1][1]
    np.testing.assert_allclose(results[2][2], results[1][2], atol=1e-4)


# ---- GGUF --------------------------------------------------------------------------------------

# llama.cpp's tensor names (gguf-py constants.py TENSOR_NAMES for MODEL_ARCH.QWEN3 / PHI3 / LLAMA,
# convert_hf_to_gguf.py), written out here rather than taken from the converter's tables.
GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3: fused, gate rows then up
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama (and Mistral) checkpoint's q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, arch: str, q8_0: bool = False) -> None:
    """What convert_hf_to_gguf.py writes for ``hf`` (F32 tensors; with ``q8_0`` the 2-D weights
    whose rows are whole 32-blocks as Q8_0, as ``--outtype q8_0`` would). ``arch``: "qwen3" (head_dim
    as attention.key_length), "phi3" (rope.dimension_count of the rotary part, the pretraining
    context beside the context, longrope factors as tensors, attention.sliding_window 0 for
    none), "llama" for Mistral (q/k rows permuted, no window kept)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_uint32(f"{arch}.rope.dimension_count", rotary)
    if arch in ("qwen3", "llama"):
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if arch == "phi3":
        w.add_uint32("phi3.rope.scaling.original_context_length", rope.get(
            "original_max_position_embeddings", cfg.max_position_embeddings))
        w.add_uint32("phi3.attention.sliding_window", cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
            w.add_float32("phi3.rope.scaling.attn_factor",
                          (1 + np.log(scale) / np.log(rope["original_max_position_embeddings"])) ** 0.5)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    symbols = sorted(bytes_to_unicode().values())
    tokens = SPECIALS + symbols + [m.replace(" ", "") for m in MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # CONTROL, NORMAL
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(TEMPLATE)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float().numpy().copy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, idx, rest = base.split(".", 3)
            gname = f"blk.{idx}.{GGUF_LAYER[rest]}.{kind}"
            if arch == "llama" and rest == "self_attn.q_proj":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
        else:
            gname = f"{GGUF_GLOBAL[base]}.{kind}"
        if q8_0 and t.ndim == 2 and t.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = {  # variant -> (GGUF architecture, HF architecture of the converted directory)
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3-partial-longrope": ("phi3", "Phi3ForCausalLM"),
    "phi3-window-tied": ("phi3", "Phi3ForCausalLM"),
}


@pytest.fixture(scope="module")
def mistral_no_window(tmp_path_factory):
    """A Mistral whose GGUF (architecture "llama", as llama.cpp writes Mistral) can say all of it:
    explicit head_dim != hidden / heads, untied, no window (llama.cpp keeps none)."""
    config = transformers.MistralConfig(**BASE, head_dim=32, sliding_window=None, rope_theta=10000.0,
                                        tie_word_embeddings=False)
    config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(11)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, seed=311)
    return hf.eval()


@pytest.mark.parametrize("name", ["qwen3", "phi3-partial-longrope", "phi3-window-tied", "mistral-as-llama"])
def test_gguf_of_the_same_weights_gives_hf_tokens(hf_models, mistral_no_window, name, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    if name == "mistral-as-llama":
        hf, (arch, hf_arch) = mistral_no_window, ("llama", "LlamaForCausalLM")
    else:
        hf, (arch, hf_arch) = hf_models[name][0], GGUF_CASES[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, hf, arch)

    model_dir = loader.resolve_model_dir(str(path))
    config = loader.load_hf_config(model_dir)
    assert loader.model_architecture(config) == hf_arch
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    session = Session(model_dir)
    if arch == "phi3":
        assert session.model.model.rotary_emb.rotary_dim == session.model.model.rotary_emb.head_dim * (
            0.5 if "partial" in name else 1)
        windows = {layer.self_attn.attn_settings.sliding_window for layer in session.model.model.layers}
        assert windows == {hf.config.sliding_window}
    prompt = _prompt(name)
    ours, our_logits = session.greedy(Seq(shuffled_blocks(12, seed=5)), prompt)
    # HF over its own cache (= generate, except for longrope past the crossing: see hf_incremental)
    want, want_logits = hf_incremental(hf, prompt)
    assert ours == want
    for got, expected in zip(our_logits, want_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert loader.load_tokenizer(model_dir).eos_token == "<|im_end|>"


@pytest.mark.slow
def test_q8_0_phi3_gguf_keeps_the_fused_projections_quantized(hf_models, tmp_path, monkeypatch):
    """A Q8_0 Phi-3 GGUF: the converter cuts ``attn_qkv`` / ``ffn_up`` and their block scales
    into the parts, so the ``gguf`` method keeps qkv_proj and gate_up_proj (and the embedding and
    head) in their blocks, as it does Llama's; its float32 torch form dequantizes exactly as
    gguf does, so the greedy tokens are those of the dequantized checkpoint."""
    from safetensors import safe_open

    from paged import LLM, SamplingParams

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_models["phi3-partial-longrope"][0]
    path = tmp_path / "phi3-q8_0.gguf"
    write_gguf(path, hf, "phi3", q8_0=True)
    model_dir = loader.resolve_model_dir(str(path))
    with safe_open(str(model_dir / "gguf_block_scales.safetensors"), "pt") as f:
        stored = set(f.keys())
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert f"model.layers.2.{part}.weight.scale" in stored, part
    assert not any("qkv_proj" in n for n in stored)  # only the parts

    prompt = _prompt("q8")
    want = Session(model_dir).greedy(Seq(shuffled_blocks(12, seed=9)), prompt, 12)[0]  # the dequantized weights
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="gguf", attention="torch", num_kv_blocks=64)
    try:
        quantizer = llm.engine.core.runner.quantizer
        # 3 layers x (qkv, o, gate_up) + embedding + head; down_proj's 112 columns are not whole blocks
        assert quantizer.counts == {"gguf": 3 * 3 + 2}
        assert sorted(quantizer.left_dense) == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_paged_run_on_each_model_directory_gives_hf_tokens(hf_models):
    """``paged run --model DIR`` (the CLI a user starts with: its own process, the directory's
    tokenizer and config) on Qwen3, Mistral with a window shorter than the sequence, and Phi-3:
    greedy token ids as HF's for the same text."""
    import json as json_module
    import subprocess
    import sys

    text = "The capital of France is Paris, and the capital of Italy is"
    for name in ("qwen3", "mistral-window", "phi3-window-tied"):
        hf, path = hf_models[name]
        prompt = tokenizer()(text)["input_ids"]
        expected = hf_generate(hf, prompt, 16)[0]
        run = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "--model", str(path), "--device", "cpu",
                              "--dtype", "float32", "--attention", "torch", "--max-tokens", "16", "--ignore-eos",
                              "--json", "-q", text], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        (request,) = json_module.loads(run.stdout)["requests"]
        assert request["token_ids"] == expected, name


@pytest.mark.slow
def test_server_gives_hf_tokens_with_chunked_prefill_and_prefix_caching(hf_models, tmp_path):
    """``paged serve`` on Mistral (window 6, shorter than every sequence) and Phi-3 (fused
    projections, a window, a tied head), each with 4-token chunks, prefix caching and 8 blocks of
    4 slots (29 slots a request: it fits only because the KV manager frees the blocks that fell
    out of the window; preemption with windows is in the ``LLM`` test above): the completions of
    token-id prompts (two sharing a 9-token prefix; one repeated alone twice after the others
    finished, the second time from the prefix cache) are HF's greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers.server import API_KEY, free_port, serve

    text = tokenizer()
    shared = _prompt("shared", 9)
    prompts = [shared + _prompt("a", 4), shared + _prompt("b", 4), _prompt("c", 13)]
    for name in ("mistral-window", "phi3-window-tied"):
        hf, path = hf_models[name]
        want = [text.decode(hf_generate(hf, p, 16)[0], skip_special_tokens=True) for p in prompts]
        port = free_port()
        args = ["--model", str(path), "--dtype", "float32", "--attention", "torch", "--port", str(port),
                "--api-key", API_KEY, "--block-size", "4", "--num-kv-blocks", "8", "--max-num-batched-tokens", "4",
                "--long-prefill-token-threshold", "4", "--enable-prefix-caching"]
        with serve(args, tmp_path, port) as server:
            def complete(prompt):
                r = server.post("/v1/completions", {"model": str(path), "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(complete, prompts))
            assert got == want, name
            # twice more, alone: the second finds the first's blocks still cached
            assert complete(prompts[0]) == want[0] and complete(prompts[0]) == want[0]
            metrics = server.metrics()
        assert metrics.get("paged:prefix_cache_hits_total", 0) > 0, (name, metrics)
