"""Gemma 2 and Gemma 3 (text) over the paged cache against HF transformers, on tiny random weights.

Each tiny model (4 layers so local and global layers both occur, GQA, a sliding window shorter
than the prompts, Gemma 2 with attention and final soft-caps and a query_pre_attn_scalar that is
not head_dim, Gemma 3 with its two rope bases and linear rope scaling on global layers) is saved
with ``save_pretrained`` and loaded by ``paged.core.loading.loader``, then run with the torch
backend on a NaN-filled paged cache whose blocks are out of order. Reference: HF's eager float32
forward and greedy ``generate`` on the same weights. Also: bfloat16 logits (plain and prepacked),
``paged.LLM`` with chunked prefill, prefix caching and preemption (and the chat template), two
tensor-parallel ranks, GGUF files written here with llama.cpp's names (F32 and Q8_0), the fused
Gemma norm and GeGLU kernels, and the errors for configs these models do not run.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.batch import make_batch
from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout
from paged.core.errors import ConfigError, ModelLoadError
from paged.core.loading import loader
from paged.models.gemma2 import Gemma2ForCausalLM, layer_types
from paged.models.gemma3 import Gemma3ForCausalLM, gemma3_rope_settings

ATOL, RTOL = 1e-4, 1e-4  # float32 against HF's float32 (the same ops, other summation orders)
BLOCK_SIZE = 4
NUM_BLOCKS = 40
WINDOW = 6  # shorter than every prompt below: the sliding layers' window matters
NEW_TOKENS = 32

# the vocabulary of the tokenizer saved with the models (byte-level BPE, see _tokenizer)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
VOCAB = 262  # 5 specials + 256 byte symbols + 1 merge

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh",
)


def gemma2_config() -> transformers.Gemma2Config:
    # every feature on and mattering: query_pre_attn_scalar != head_dim, soft-caps small enough to bend
    return transformers.Gemma2Config(
        **COMMON, query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=6.0,
        rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="eager",
    )


def gemma3_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        **COMMON, query_pre_attn_scalar=16, final_logit_softcapping=None, attn_logit_softcapping=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_theta=100000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=False, attn_implementation="eager",
    )


VARIANTS = {"gemma2": (gemma2_config, "Gemma2ForCausalLM"), "gemma3": (gemma3_config, "Gemma3ForCausalLM")}
FACTORIES = {"Gemma2ForCausalLM": Gemma2ForCausalLM, "Gemma3ForCausalLM": Gemma3ForCausalLM}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every part matter: Gemma norms' ``w`` around 0 (the scale is ``1 + w``),
    unit-variance embeddings, 1/sqrt(fan-in) projections."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _tokenizer():
    """A byte-level BPE tokenizer of ``VOCAB`` ids with Gemma's turn markers, a BOS added to
    every encoding (as Gemma's tokenizer does) and a Gemma-style chat template (no system role;
    the template writes the BOS itself)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(SPECIALS + symbols + ["Ġt"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = GEMMA_TEMPLATE
    assert len(fast) == VOCAB
    return fast


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Numerics, not speed: on a shared 2-core machine two OpenMP threads wait on each other at
    every small op (HF generate here: 0.4 s with one thread, 5 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model, float32 eval, saved directory with a tokenizer)."""
    out = {}
    for i, (name, (make_config, arch)) in enumerate(VARIANTS.items()):
        config = make_config()
        config.architectures = [arch]
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(hf, seed=200 + i)
        hf.eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        _tokenizer().save_pretrained(path)
        out[name] = (hf, path)
    return out


# ---- a paged session -------------------------------------------------------------------------


class Seq:
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.num_computed = 0


class Session:
    """Our model + torch backend + a NaN-filled paged cache (a read of an unwritten slot shows)."""

    def __init__(self, model_dir, dtype: torch.dtype = torch.float32) -> None:
        self.config = loader.load_hf_config(model_dir)
        factory = FACTORIES[loader.model_architecture(self.config)]
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


def shuffled_blocks(n: int, seed: int) -> list[int]:
    blocks = list(range(1, NUM_BLOCKS))  # block 0 stays unused: the block table's padding value
    random.Random(seed).shuffle(blocks)
    return blocks[:n]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy ``n`` tokens with EOS an ordinary token (as ``ignore_eos``; ``min_new_tokens``
    would instead forbid it)."""
    hf.generation_config.eos_token_id = None  # generate() fills unset fields from the model's
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


# ---- parity ----------------------------------------------------------------------------------


def test_the_configs_exercise_what_they_claim(hf_models):
    for name in VARIANTS:
        types = layer_types(hf_models[name][0].config, 2)
        assert {"sliding_attention", "full_attention"} <= set(types)
        model = Session(hf_models[name][1]).model
        windows = [layer.self_attn.attn_settings.sliding_window for layer in model.model.layers]
        assert windows == [WINDOW if t == "sliding_attention" else None for t in types]
    g2 = Session(hf_models["gemma2"][1]).model.model.layers[0].self_attn.attn_settings
    assert (g2.logits_soft_cap, g2.scale) == (3.0, 24**-0.5)
    rotaries = Session(hf_models["gemma3"][1]).model.model.rotaries
    assert rotaries["sliding_attention"] is not rotaries["full_attention"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_and_greedy_decode_match_hf(hf_models, name):
    hf, path = hf_models[name]
    session = Session(path)
    rng = random.Random(name)
    prompt = [rng.randrange(3, VOCAB) for _ in range(15)]
    seq = Seq(shuffled_blocks(14, seed=len(name)))

    logits = session.step([(seq, prompt)], all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)

    ids = list(prompt)
    for i in range(NEW_TOKENS):
        ids.append(int(logits[-1].argmax()))
        if i == NEW_TOKENS - 1:
            break
        logits = session.step([(seq, [ids[-1]])])
        if i % 8 == 0:  # spot checks; the tokens below check every step
            torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=RTOL)
    assert ids[len(prompt):] == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_and_mixed_batch_match_hf(hf_models, name):
    """A's prefill in two chunks (the second after a cached prefix longer than the window)
    alongside B's whole prefill, then both decoding in one batch."""
    hf, path = hf_models[name]
    session = Session(path)
    rng = random.Random(7)
    prompt_a = [rng.randrange(3, VOCAB) for _ in range(17)]
    prompt_b = [rng.randrange(3, VOCAB) for _ in range(9)]
    blocks = shuffled_blocks(16, seed=3)
    a, b = Seq(blocks[:8]), Seq(blocks[8:])

    session.step([(a, prompt_a[:9])])
    logits = session.step([(a, prompt_a[9:]), (b, prompt_b)], all_logits=True)
    torch.testing.assert_close(logits[:8], hf_logits(hf, prompt_a)[9:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[8:], hf_logits(hf, prompt_b), atol=ATOL, rtol=RTOL)

    ids_a, ids_b = list(prompt_a), list(prompt_b)
    last_a, last_b = logits[7], logits[-1]
    for _ in range(4):
        ids_a.append(int(last_a.argmax()))
        ids_b.append(int(last_b.argmax()))
        last_a, last_b = session.step([(a, [ids_a[-1]]), (b, [ids_b[-1]])])
        torch.testing.assert_close(last_a, hf_logits(hf, ids_a)[-1], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(last_b, hf_logits(hf, ids_b)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bfloat16_logits_close_to_float32_hf(hf_models, name):
    """bfloat16 (plain and with the oneDNN-packed linears of a CPU run): every logit within 0.05
    of the largest |logit| of HF's float32 ones (bfloat16 keeps 8 bits: ~0.4% per rounding)."""
    hf, path = hf_models[name]
    prompt = list(range(10, 30))
    ref = hf_logits(hf, prompt)
    for prepack in (False, True):
        session = Session(path, dtype=torch.bfloat16)
        if prepack:
            assert session.model.prepack_weights() > 0
        got = session.step([(Seq([1, 2, 3, 4, 5]), prompt)], all_logits=True)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max() < 0.05 * ref.abs().max(), (name, prepack)


# ---- the engine ------------------------------------------------------------------------------


def test_llm_chunked_prefill_prefix_caching_and_chat(hf_models):
    """``paged.LLM`` on both models: prompts sharing a prefix, 8-token chunks, prefix caching on
    and too few blocks for all three (preemption by recompute): greedy tokens identical to HF
    generate; ``chat`` renders the checkpoint's own template (Gemma's turn markers, no system
    role)."""
    from paged import LLM, SamplingParams

    rng = np.random.default_rng(0)
    shared = rng.integers(5, VOCAB, 12).tolist()
    prompts = [shared + rng.integers(5, VOCAB, n).tolist() for n in (3, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for name in VARIANTS:
        hf, path = hf_models[name]
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        llm = LLM(str(path), device="cpu", dtype="float32", attention="torch", block_size=4, num_kv_blocks=24,
                  max_num_batched_tokens=8, long_prefill_token_threshold=8, enable_prefix_caching=True)
        llm.generate([shared + [7]], params, use_tqdm=False)  # the shared prefix, cached
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, name
        assert sum(o.metrics.num_cached_tokens for o in outs) >= 8, name  # the shared prefix's full blocks
        assert sum(o.metrics.num_preemptions for o in outs) > 0, name  # 24 blocks hold two of the three
        if name == "gemma3":
            chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False)[0]
            tokenizer = _tokenizer()
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
            assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
            # one BOS: the template's (the tokenizer's own is not added to a rendered chat)
            assert chat.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
            assert chat.prompt_token_ids.count(2) == 1
            with pytest.raises(Exception, match="System role not supported"):
                llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                         SamplingParams(max_tokens=1), use_tqdm=False)
        llm.shutdown()


@pytest.mark.slow
def test_server_completions_and_chat(hf_models, tmp_path):
    """``paged serve`` on Gemma 2 with two tensor-parallel ranks (each 2 of the 4 q heads, 1 of
    the 2 kv heads, half the vocabulary of the tied head; windows and soft-caps per layer as with
    one), chunked prefill and prefix caching: a completion of token ids gives HF's greedy text; a
    chat renders Gemma's template (HF's greedy continuation of it); a system message, which
    Gemma's template refuses, is a 400 naming the template's reason."""
    from helpers.server import API_KEY, free_port, serve

    hf, path = hf_models["gemma2"]
    tokenizer = _tokenizer()
    port = free_port()
    args = ["--model", str(path), "--dtype", "float32", "--attention", "torch", "--port", str(port), "--api-key",
            API_KEY, "--block-size", "4", "--max-num-batched-tokens", "8", "--long-prefill-token-threshold", "8",
            "--enable-prefix-caching", "--tensor-parallel-size", "2"]
    prompt = list(range(30, 47))
    with serve(args, tmp_path, port) as server:
        r = server.post("/v1/completions", {"model": str(path), "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(hf, prompt, 16))
        messages = [{"role": "user", "content": "the tea"}]
        r = server.post("/v1/chat/completions", {"model": str(path), "messages": messages, "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(hf_greedy(hf, ids, 8))
        r = server.post("/v1/chat/completions", {"model": str(path), "max_tokens": 4,
                                                 "messages": [{"role": "system", "content": "be brief"}, *messages]})
        assert r.status_code == 400 and "System role not supported" in r.text, r.text


# ---- GGUF --------------------------------------------------------------------------------------

# llama.cpp's names (gguf-py constants.py TENSOR_NAMES for MODEL_ARCH.GEMMA2 / GEMMA3), written
# out here rather than taken from the converter's tables.
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf(path, hf, arch: str, q8_0: bool = False) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for ``hf`` (F32; with ``q8_0`` the layers'
    projections whose rows are whole 32-blocks as Q8_0, and ``hf`` then given the dequantized
    weights, so that it stays the exact reference): every ``*norm.weight``
    stored as ``1 + w`` (Gemma2Model / Gemma3Model.modify_tensors), no q/k permutation, the tied
    head left out; Gemma 2 with both soft-caps and the window, Gemma 3 with the global rope base,
    the window and the rope scaling (llama.cpp fixes local layers at base 10000 and every sixth
    layer global, so this Gemma 3 is the 6-layer pattern with that base)."""
    import gguf

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    symbols = sorted(bytes_to_unicode().values())
    w.add_token_list(SPECIALS + symbols + ["Ġt"])
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_chat_template(GEMMA_TEMPLATE)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float().numpy().copy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, idx, rest = base.split(".", 3)
            gname = f"blk.{idx}.{GGUF_LAYER_NAMES[rest]}.{kind}"
        else:
            gname = f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
        if name.endswith("norm.weight"):
            t = t + 1.0
        if q8_0 and base.startswith("model.layers.") and t.ndim == 2 and t.shape[1] % 32 == 0:
            codes = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(codes, gguf.GGMLQuantizationType.Q8_0)))
            w.add_tensor(gname, codes, raw_shape=codes.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_reference(arch: str):
    """An HF model whose config is what llama.cpp runs for the GGUF (Gemma 3: 6-layer pattern,
    local base 10000; scalar = head_dim, as llama.cpp derives it for these sizes)."""
    if arch == "gemma2":
        config = gemma2_config()
        config.query_pre_attn_scalar = config.head_dim  # llama.cpp: 1/sqrt(head_dim) unless 27B
    else:
        config = transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 6}, query_pre_attn_scalar=16, rope_theta=100000.0,
            rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True, attn_implementation="eager",
        )
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, seed=300)
    return hf.eval()


@pytest.mark.parametrize("arch,q8_0", [("gemma2", False), ("gemma3", False), ("gemma3", True)])
def test_gguf_gives_hf_tokens(arch, q8_0, tmp_path, monkeypatch):
    """F32: the converted directory is HF's checkpoint. Q8_0: run as stored (``quantization
    gguf``: codes and block scales, the "exact few-rows" float32 kernels) against HF on the
    dequantized weights."""
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    hf = gguf_reference(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, arch, q8_0)

    model_dir = loader.resolve_model_dir(str(path))
    config = loader.load_hf_config(model_dir)
    assert loader.model_architecture(config) == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    assert layer_types(config, 0) == list(hf.config.layer_types)
    session = Session(model_dir)
    prompt = [5, 77, 200, 3, 140, 9, 61, 250, 33, 18, 90, 4]
    logits = session.step([(Seq(shuffled_blocks(12, seed=1)), prompt)], all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)

    from paged import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", attention="torch", block_size=4, num_kv_blocks=32,
              quantization="gguf" if q8_0 else "none")
    if q8_0:  # per layer qkv, gate_up (input 64); down_proj's 112 inputs are not whole blocks: dense
        assert llm.engine.core.runner.quantizer.counts == {"gguf": 3 * hf.config.num_hidden_layers}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert llm.tokenizer.chat_template == GEMMA_TEMPLATE
    llm.shutdown()


# ---- pieces ----------------------------------------------------------------------------------


def test_gelu_tanh_and_mul_kernel_matches_torch():
    from paged.models import cpu_layer_ops

    ops = cpu_layer_ops.load()
    if ops is None:
        pytest.skip("CPU layer kernels unavailable")
    torch.manual_seed(0)
    x = torch.randn(9, 2 * 72) * 3
    x[0, :6] = torch.tensor([-30.0, -8.0, -1e-3, 0.0, 4.0, 30.0])
    gate, up = x.split(72, dim=-1)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5)
    xb = x.bfloat16()
    ref = (F.gelu(xb[:, :72].double(), approximate="tanh").bfloat16().double() * xb[:, 72:].double()).bfloat16()
    # against the exactly rounded value: at most one bfloat16 step off (rounding boundaries)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(xb).float(), ref.float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_matches_hf(dtype):
    """Our (fused, on CPUs) Gemma norm against HF's Gemma2RMSNorm: bfloat16 bit-identical (one
    rounding after the float32 (1 + w)); float32 within the sum-of-squares order."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from paged.models.gemma2 import GemmaRMSNorm

    torch.manual_seed(0)
    hf = Gemma2RMSNorm(48, eps=1e-6)
    ours = GemmaRMSNorm(48, 1e-6, dtype=dtype, device="cpu")
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(48))
        hf.to(dtype)
        ours.weight.copy_(hf.weight)
    ours.prepare()
    x, residual = torch.randn(7, 48).to(dtype) * 3, torch.randn(7, 48).to(dtype)
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), **exact)
        normed, summed = ours(x, residual)
        torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(normed, hf(x + residual), **exact)


def test_layer_pattern_and_rope_settings_without_layer_types():
    cfg = type("Cfg", (), {"num_hidden_layers": 7, "layer_types": None})()
    assert layer_types(cfg, 6) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert layer_types(cfg, 2)[:4] == ["sliding_attention", "full_attention"] * 2
    cfg.layer_types = ["sliding_attention", "chunked_attention"] + ["full_attention"] * 5
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        layer_types(cfg, 6)
    old = type("Old", (), {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                           "rope_local_base_freq": 10000.0})()
    assert gemma3_rope_settings(old) == {
        "sliding_attention": (10000.0, None), "full_attention": (1e6, {"rope_type": "linear", "factor": 8.0})
    }


def test_unsupported_configs_are_named(tmp_path):
    backend = TorchAttentionBackend(AttentionLayout(4, 4, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu")))
    bad = gemma2_config()
    bad.hidden_activation = "relu"
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'.*gelu_pytorch_tanh"):
        Gemma2ForCausalLM(bad, backend, torch.float32, "cpu")
    bad = gemma3_config()
    bad.attn_logit_softcapping = 50.0
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping 50.0"):
        Gemma3ForCausalLM(bad, backend, torch.float32, "cpu")
    bad = gemma2_config()
    bad.use_bidirectional_attention = True
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        Gemma2ForCausalLM(bad, backend, torch.float32, "cpu")


def test_plugin_registers_gemma_and_refuses_the_multimodal_gemma3(tmp_path):
    import paged.plugins.models as plugin
    from paged.core.registry import load_plugins

    registry = load_plugins(entry_points=[], modules=[("models", plugin)], allow=None, deny=set())
    assert registry.model("Gemma2ForCausalLM").factory is Gemma2ForCausalLM
    assert registry.model("Gemma3ForCausalLM").factory is Gemma3ForCausalLM
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2},
    }))
    from paged import LLM

    with pytest.raises((ModelLoadError, ConfigError), match="Gemma3ForConditionalGeneration.*not supported"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


@pytest.mark.slow
def test_paged_run_gives_hf_tokens_with_gemma3_on_two_ranks(hf_models):
    """``paged run --model DIR`` (its own process and the directory's tokenizer, which adds a
    BOS) on Gemma 2 with one rank and Gemma 3 with two (each rank 2 of the 4 q heads and 1 of the
    2 kv heads; local and global layers with their own rope bases; a window shorter than the
    sequence): greedy token ids as HF's for the same text."""
    import subprocess
    import sys

    text = "the tea and the toast"
    prompt = _tokenizer()(text)["input_ids"]
    assert prompt[0] == 2 and len(prompt) > WINDOW
    for name, ranks in (("gemma2", "1"), ("gemma3", "2")):
        hf, path = hf_models[name]
        run = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "--model", str(path), "--device", "cpu",
                              "--dtype", "float32", "--attention", "torch", "--tensor-parallel-size", ranks,
                              "--max-tokens", "16", "--ignore-eos", "--json", "-q", text],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        (request,) = json.loads(run.stdout)["requests"]
        assert request["token_ids"] == hf_greedy(hf, prompt, 16), name
