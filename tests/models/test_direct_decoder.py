"""The direct decoder path (``paged.models.direct_decoder``) computes what the module tree
computes, bit for bit, and stands aside wherever it would not.

Reference: the same model's ``nn.Module`` path, run on the same step inputs right after the direct
one (the KV write is the same values twice). HF parity of the direct path itself is what every
Llama/Qwen2 test against HF transformers checks (``test_llama_qwen2.py``, the engine parity
tests), since it is the path those tests now run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from helpers.tiny_llama import PROMPT, TINY
from paged import LLM, SamplingParams
from paged.models.direct_decoder import DirectDecoder
from paged.models import llama
from paged.models.layers import Attention, GatedMLP
from paged.models.llama import LlamaForCausalLM, attention_block
from paged.models.qwen3 import Qwen3ForCausalLM

PROMPTS = [PROMPT * 7, list(range(300, 341)), PROMPT]  # 42, 41 and 6 tokens: chunked, then mixed steps


def _save(path: Path, default_model_dir: str, config: transformers.PretrainedConfig) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # biases are zero when made: random ones, so that adding them shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


def _both_paths(llm: LLM, monkeypatch) -> list[tuple[int, bool, bool]]:
    """Make every forward of ``llm`` run through the modules, then direct on the same inputs
    (so the direct path's KV writes are the ones later steps read); returns per forward
    (tokens, the direct path ran, outputs bitwise equal)."""
    model = llm.engine.core.runner.model.model
    forward = type(model).forward
    seen: list[tuple[int, bool, bool]] = []
    ran: list[int] = []
    layers = DirectDecoder._layers

    def counted(self, *args):
        ran.append(1)
        return layers(self, *args)

    monkeypatch.setattr(DirectDecoder, "_layers", counted)

    def both(input_ids, positions, kv_caches, attn_metadata):
        kept, model._direct = model._direct, None  # None: the modules
        try:
            modules = forward(model, input_ids, positions, kv_caches, attn_metadata)
        finally:
            model._direct = kept
        before = len(ran)
        direct = forward(model, input_ids, positions, kv_caches, attn_metadata)
        seen.append((input_ids.shape[0], len(ran) == before + 1, torch.equal(direct, modules)))
        return direct

    model.forward = both
    return seen


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**{**TINY, "tie_word_embeddings": False}),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=8),  # a window shorter than the prompts
    # q/k norms, a head_dim that is not hidden / heads, q/k/v biases, a sliding layer
    "qwen3": lambda: transformers.Qwen3Config(**{**TINY, "tie_word_embeddings": False}, head_dim=16,
                                              attention_bias=True, use_sliding_window=True, sliding_window=8,
                                              max_window_layers=1),
    "phi3": lambda: transformers.Phi3Config(**TINY, partial_rotary_factor=0.5),  # rotary over half of each head
}


@pytest.mark.parametrize("kind, dtype", [("llama", "float32"), ("qwen2", "bfloat16"), ("mistral", "float32"),
                                         ("qwen3", "bfloat16"), ("phi3", "float32"), ("default", "bfloat16")])
def test_direct_layers_equal_the_modules_bit_for_bit(kind, dtype, tmp_path, default_model_dir, monkeypatch):
    """Prefill chunks of 16 tokens, mixed steps and decode of three requests, each forward on both
    paths: equal outputs. Llama in float32 (dense weights), Qwen2 with q/k/v biases in bfloat16
    (oneDNN-packed weights), Mistral with a sliding window (the attention's settings), Qwen3's
    q/k norms, Phi-3's partial rotary, the default model's GGUF in bfloat16 (its Q4_1 blocks kept)."""
    if kind == "default":
        model_dir, extra = default_model_dir, {}
    else:
        model_dir, extra = str(_save(tmp_path / kind, default_model_dir, CONFIGS[kind]())), {"quantization": "none"}
    llm = LLM(model_dir, device="cpu", dtype=dtype, attention="torch", max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=64, **extra)
    seen = _both_paths(llm, monkeypatch)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert len(seen) >= 12 and any(t > 1 for t, _, _ in seen) and any(t == 3 for t, _, _ in seen), seen
    assert all(used for _, used, _ in seen), seen
    assert all(equal for _, _, equal in seen), seen
    # the decode steps of GGUF weights ran as one C++ call (DecoderPlan); dense weights never do
    plan_steps = llm.engine.core.runner.model.model._direct.plan_steps
    assert plan_steps > 0 if kind == "default" else plan_steps == 0


def test_decoder_plan_runs_verifications_as_the_python_loop_does(default_model_dir, monkeypatch):
    """Speculative verifications (query rows in groups, ``write_and_decode_grouped``) and plain
    decodes through the C++ plan, each against the modules on the same inputs: equal outputs,
    and the greedy tokens those of the Python loop (``PAGED_DIRECT_PLAN=0``)."""
    prompt = "one two three four five six seven eight nine ten " * 6
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(default_model_dir, device="cpu", dtype="bfloat16", attention="torch", speculative_config=spec)
    seen = _both_paths(llm, monkeypatch)
    tokens = llm.generate([prompt, prompt[:40]], params, use_tqdm=False)
    assert any(t > 2 for t, _, _ in seen) and all(equal for _, _, equal in seen), seen
    direct = llm.engine.core.runner.model.model._direct
    assert direct.plan_steps > 0
    monkeypatch.setenv("PAGED_DIRECT_PLAN", "0")
    python_loop = LLM(default_model_dir, device="cpu", dtype="bfloat16", attention="torch", speculative_config=spec)
    expected = python_loop.generate([prompt, prompt[:40]], params, use_tqdm=False)
    assert python_loop.engine.core.runner.model.model._direct.plan_steps == 0
    assert [o.outputs[0].token_ids for o in tokens] == [o.outputs[0].token_ids for o in expected]


def test_decoder_plan_on_a_mix_of_block_types(tmp_path, monkeypatch):
    """A GGUF whose q, k and v are three block types (row-stacked parts, each its own gemm, then
    concatenated) and whose other projections are six more: every decode step through the plan,
    equal to the modules on the same inputs; and with the attention backends swapped on the
    modules afterwards, the direct path calls the new ones."""
    from helpers.gguf_blocks import write_tiny_quantized_gguf
    from paged.core.loading.quantize import RowStackedWeight

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-mixed.gguf"
    write_tiny_quantized_gguf(path)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", attention="torch", max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=64)
    model = llm.engine.core.runner.model.model
    assert isinstance(model.layers[0].self_attn.qkv_proj.qweight, RowStackedWeight)
    seen = _both_paths(llm, monkeypatch)
    prompts = [[5, 77, 200, 3, 140, 9, 61, 250, 33], [17, 4, 99, 180, 12], list(range(40, 71))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert all(equal for _, _, equal in seen), seen
    assert model._direct.plan_steps >= 6

    # attention backends swapped on the modules after the first forward (gpu_check's throughput
    # section does this): the direct layers call the new ones, not the plan built for the old
    # ones; then a backend of the stock class again: the plan is built and runs again
    from paged.backends.torch_attention import TorchAttentionBackend

    calls = []

    class Counted(TorchAttentionBackend):
        def forward(self, *args, **kwargs):
            calls.append(args[0].shape[0])
            return super().forward(*args, **kwargs)

    attentions = [layer.self_attn for layer in model.layers]
    for attn in attentions:
        attn.backend = Counted(attn.backend.layout)
    plan_steps, before = model._direct.plan_steps, len(seen)
    llm.generate(prompts, params, use_tqdm=False)
    forwards = seen[before:]
    assert forwards and all(used and equal for _, used, equal in forwards), forwards
    # each forward calls every layer's backend twice: the modules' pass, then the direct one
    assert len(calls) == 2 * len(attentions) * len(forwards), (len(calls), len(forwards))
    assert model._direct.plan_steps == plan_steps
    for attn in attentions:
        attn.backend = TorchAttentionBackend(attn.backend.layout)
    before = len(seen)
    llm.generate(prompts, params, use_tqdm=False)
    assert all(used and equal for _, used, equal in seen[before:]), seen[before:]
    assert model._direct.plan_steps >= plan_steps + 6


def test_hooks_patches_and_other_layers_keep_the_modules(tmp_path, default_model_dir, monkeypatch):
    model_dir = _save(tmp_path / "llama", default_model_dir, transformers.LlamaConfig(**TINY))
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention="torch", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    model = llm.engine.core.runner.model.model
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    direct = model._direct
    assert isinstance(direct, DirectDecoder)
    hidden = torch.zeros(1, TINY["hidden_size"])
    assert direct.usable(hidden) is not None

    # a forward hook on a module the direct path skips: the modules run, and the hook sees every step
    calls = []
    handle = model.layers[1].mlp.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
    assert direct.usable(hidden) is None
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert calls and len(calls) >= 4, calls
    handle.remove()
    assert direct.usable(hidden) is not None
    global_handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert direct.usable(hidden) is None
    finally:
        global_handle.remove()
    assert direct.usable(hidden.to(torch.float64)) is None  # a dtype the layer kernels do not take

    # a class patched after the first forward (a researcher's experiment): its code runs
    patched = []
    with monkeypatch.context() as m:
        m.setattr(GatedMLP, "forward", lambda self, x, _f=GatedMLP.forward: (patched.append(x.shape[0]), _f(self, x))[1])
        assert direct.usable(hidden) is None
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert len(patched) >= 4 * TINY["num_hidden_layers"], patched
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(llama, "attention_block", lambda *args: (calls.append(1), attention_block(*args))[1])
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert len(calls) >= 4 * TINY["num_hidden_layers"], calls
    assert direct.usable(hidden) is not None

    # read once: a wrapper on one module's instance, another attention, or the switch: no direct path
    layer_type = type(model.layers[0])
    with monkeypatch.context() as m:
        m.setattr(model.layers[1].mlp.down_proj, "forward", lambda x: x, raising=False)
        assert DirectDecoder.of(model, layer_type) is None
    with monkeypatch.context() as m:
        m.setenv("PAGED_DIRECT_LAYERS", "0")
        assert DirectDecoder.of(model, layer_type) is None
    assert DirectDecoder.of(model, layer_type) is not None
    # a model plugin's own attention (a subclass of Attention, as the README's plugins write it)
    class OwnAttention(Attention):
        pass

    class OwnModel(LlamaForCausalLM):
        @classmethod
        def build_attention(cls, hf_config, layer_idx, rotary, backend, *, dtype, device):
            _, heads, kv_heads, head_dim = cls.attention_shape(hf_config)
            return OwnAttention(hf_config.hidden_size, heads, kv_heads, head_dim, rotary, backend, dtype=dtype,
                                device=device)

    own = OwnModel(transformers.LlamaConfig(**TINY), model.layers[0].self_attn.backend, torch.float32, "cpu")
    assert DirectDecoder.of(own.model, type(own.model.layers[0])) is None
    qwen3 = Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, "head_dim": 8}), model.layers[0].self_attn.backend,
                             torch.float32, "cpu")
    assert DirectDecoder.of(qwen3.model, type(qwen3.model.layers[0])) is not None  # registered by paged.models.qwen3
