"""MoE GGUFs written with the ``gguf`` package (llama.cpp's tensor names and metadata keys,
hardcoded here) give HF transformers' greedy tokens (32) on the same weights.

* Qwen2-MoE (``qwen2moe``) with its experts kept quantized: the tiny HF model's expert weights
  are rounded through Q8_0 (the shared expert through Q4_0) and the HF model is given the
  rounded values, so HF float32 on those weights is the reference; paged unstacks the stacked
  experts (``blk.N.ffn_{gate,up,down}_exps``, ``[n_expert, rows, cols]``) into HF's per-expert
  names and keeps their blocks (``quantization=gguf``: the float32 torch form dequantizes exactly
  as gguf does); chunked prefill and prefix caching on.
* Mixtral (``llama`` with ``expert_count``; q/k rows permuted as llama.cpp does) and Qwen3-MoE
  (``qwen3moe``: per-head q/k norms, explicit head size), float32.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

EXPERTS, TOP_K, HIDDEN, EXPERT_WIDTH, SHARED_WIDTH, LAYERS = 8, 2, 64, 32, 64, 3
GREEDY = 32


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]


def _rounded(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, np.ndarray]:
    """``w`` through the GGUF block type: (dequantized float32 tensor, raw blocks)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    blocks = gguf.quants.quantize(w.numpy().astype(np.float32), qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(w.shape).copy()), blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model on the rounded weights, GGUF path)."""
    import gguf

    vocab = len(_tokens())
    config = transformers.Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=SHARED_WIDTH, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen2MoeForCausalLM"],
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    # HF's checkpoint names (one tensor per expert), from its own save format
    path = tmp_path_factory.mktemp("moe-gguf")
    hf.save_pretrained(path / "hf")
    from safetensors.torch import load_file

    state = load_file(str(path / "hf" / "model.safetensors"))

    w = gguf.GGUFWriter(str(path / "tiny-qwen2moe.gguf"), "qwen2moe")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32("qwen2moe.expert_count", EXPERTS)
    w.add_uint32("qwen2moe.expert_used_count", TOP_K)
    w.add_uint32("qwen2moe.expert_feed_forward_length", EXPERT_WIDTH)
    w.add_uint32("qwen2moe.expert_shared_feed_forward_length", SHARED_WIDTH)
    tokens = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    def f32(name: str, hf_name: str) -> None:
        w.add_tensor(name, state[hf_name].numpy().astype(np.float32))

    f32("token_embd.weight", "model.embed_tokens.weight")
    f32("output_norm.weight", "model.norm.weight")
    f32("output.weight", "lm_head.weight")
    rounded: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        f32(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        f32(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        for short, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            f32(f"blk.{i}.attn_{short}.weight", p + f"self_attn.{proj}.weight")
            f32(f"blk.{i}.attn_{short}.bias", p + f"self_attn.{proj}.bias")
        f32(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        f32(f"blk.{i}.ffn_gate_inp.weight", p + "mlp.gate.weight")
        # llama.cpp writes the shared expert's gate [1, hidden] as it is
        f32(f"blk.{i}.ffn_gate_inp_shexp.weight", p + "mlp.shared_expert_gate.weight")
        for proj in ("gate", "up", "down"):
            stacked = torch.stack([state[p + f"mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)])
            deq, blocks = _rounded(stacked, "Q8_0")
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            for e in range(EXPERTS):
                rounded[p + f"mlp.experts.{e}.{proj}_proj.weight"] = deq[e]
            deq, blocks = _rounded(state[p + f"mlp.shared_expert.{proj}_proj.weight"], "Q4_0")
            w.add_tensor(f"blk.{i}.ffn_{proj}_shexp.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            rounded[p + f"mlp.shared_expert.{proj}_proj.weight"] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # the reference: HF on the rounded weights (loaded through its own per-expert checkpoint format)
    state.update(rounded)
    from safetensors.torch import save_file

    save_file(state, str(path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32).eval()
    return reference, path / "tiny-qwen2moe.gguf"


def test_qwen2_moe_gguf_greedy_tokens_equal_hf_with_experts_kept_quantized(tiny, tmp_path, monkeypatch):
    from paged import LLM, SamplingParams
    from paged.core.loading.gguf import BLOCK_SCALES_FILE, converted_model_dir

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    reference, gguf_path = tiny
    converted = converted_model_dir(gguf_path)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 32)
    assert config["shared_expert_intermediate_size"] == 64 and config["norm_topk_prob"] is False

    from safetensors import safe_open

    with safe_open(str(converted / BLOCK_SCALES_FILE), "pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
    assert kinds["model.layers.2.mlp.experts.7.down_proj.weight"] == "q8_0"
    assert kinds["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "q4_0"

    llm = LLM(str(gguf_path), device="cpu", dtype="float32", quantization="gguf", attention="torch", num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=5, enable_prefix_caching=True)
    quantizer = llm.engine.core.runner.quantizer
    # per layer: 8 experts x (gate_up, down) + the shared expert's 2, every one kept in its blocks
    assert quantizer.counts == {"gguf": LAYERS * (EXPERTS * 2 + 2)}
    params = SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True)
    prompts = [[5, 77, 200, 3, 140, 9, 61, 250, 33, 12, 71], [5, 77, 200, 3, 140, 9, 61, 250, 33, 99]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY, min_new_tokens=GREEDY,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == want


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for Llama q/k (each head's two rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_mixtral_gguf_greedy_tokens_equal_hf(tmp_path, monkeypatch):
    """Mixtral as llama.cpp writes it: ``general.architecture = llama`` with ``llama.expert_count``,
    q/k rows permuted, experts stacked from ``w1`` (gate), ``w3`` (up), ``w2`` (down); float32."""
    import gguf

    from paged import LLM, SamplingParams
    from paged.core.loading.gguf import converted_model_dir

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    tokens = _tokens()
    config = transformers.MixtralConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=EXPERT_WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, architectures=["MixtralForCausalLM"],
    )
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else scale * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file

    state = {k: v.numpy() for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}

    path = tmp_path / "tiny-mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(EXPERT_WIDTH)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // 4)
    w.add_uint32("llama.expert_count", EXPERTS)
    w.add_uint32("llama.expert_used_count", TOP_K)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(state[p + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(state[p + "self_attn.k_proj.weight"], 2))
        w.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state[p + "block_sparse_moe.gate.weight"])
        for short, hf_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            stacked = np.stack([state[p + f"block_sparse_moe.experts.{e}.{hf_name}.weight"] for e in range(EXPERTS)])
            w.add_tensor(f"blk.{i}.ffn_{short}_exps.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    converted = json.loads((converted_model_dir(path) / "config.json").read_text())
    assert converted["architectures"] == ["MixtralForCausalLM"] and converted["num_local_experts"] == EXPERTS
    params = SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True)
    prompt = [5, 77, 200, 3, 140, 9, 61, 250, 33]
    with LLM(str(path), device="cpu", dtype="float32", attention="torch", num_kv_blocks=64) as llm:
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == want
    assert len(set(want)) > 3


def test_qwen3_moe_gguf_greedy_tokens_equal_hf(tmp_path, monkeypatch):
    """Qwen3-MoE as llama.cpp writes it (``qwen3moe``): per-head ``attn_q_norm`` / ``attn_k_norm``,
    an explicit head size (``attention.key_length`` 24, not 64 / 4), no q/k permutation,
    experts stacked; the top-k renormalised (llama.cpp's default for this architecture); float32."""
    import gguf

    from paged import LLM, SamplingParams
    from paged.core.loading.gguf import converted_model_dir

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    tokens = _tokens()
    head_dim = 24
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else scale * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file

    state = {k: v.numpy() for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}

    path = tmp_path / "tiny-qwen3moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32("qwen3moe.expert_count", EXPERTS)
    w.add_uint32("qwen3moe.expert_used_count", TOP_K)
    w.add_uint32("qwen3moe.expert_feed_forward_length", EXPERT_WIDTH)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}
        for short, hf_name in names.items():
            w.add_tensor(f"blk.{i}.{short}.weight", state[p + hf_name + ".weight"])
        for proj in ("gate", "up", "down"):
            stacked = np.stack([state[p + f"mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)])
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    converted = json.loads((converted_model_dir(path) / "config.json").read_text())
    assert converted["architectures"] == ["Qwen3MoeForCausalLM"] and converted["norm_topk_prob"] is True
    assert converted["head_dim"] == head_dim
    params = SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True)
    prompt = [5, 77, 200, 3, 140, 9, 61, 250, 33]
    with LLM(str(path), device="cpu", dtype="float32", attention="torch", num_kv_blocks=64) as llm:
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == want
    assert len(set(want)) > 3
