"""Weight-only quantization: the GGUF block scales, the bundled int8/int4 methods, auto choice,
memory, and the quantized model end to end through the engine."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from paged.core.loading import gguf as gguf_loading
from paged.core.loading import loader
from paged.core.loading.quantize import load_block_scales, make_quantizer
from paged.core.quantization import BlockScales, choose_auto
from paged.core.registry import get_registry
from paged.plugins.quantization import Int4Options, WeightOnlyOptions, int4_group_codes, quantize_int4, quantize_int8


@functools.cache
def _gguf_reader():
    """The default model's file, parsed once per process (gguf's reader parses the whole vocabulary)."""
    import gguf

    return gguf.GGUFReader(str(gguf_loading.default_gguf_path()))


def _gguf_tensor(name: str):
    return next(t for t in _gguf_reader().tensors if t.name == name)


def _q4_1_nibbles(raw: np.ndarray, rows: int) -> np.ndarray:
    """Codes of Q4_1 blocks read straight from the bytes (d f16, m f16, 16 bytes: element j < 16
    is the low nibble of byte j, element 16 + j its high nibble)."""
    qs = np.ascontiguousarray(raw).reshape(-1, 20)[:, 4:]
    return np.concatenate([qs & 15, qs >> 4], axis=1).reshape(rows, -1).astype(np.int32)


def test_q4_1_blocks_dequantize_bit_exactly_like_gguf():
    from gguf.quants import dequantize

    t = _gguf_tensor("blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    raw = t.data.view(np.ndarray)
    reference = torch.from_numpy(np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32).reshape(rows, cols))
    scale, offset = gguf_loading.block_scales(raw, "Q4_1", (rows, cols))
    blocks = BlockScales("q4_1", torch.from_numpy(scale), torch.from_numpy(offset))
    codes = blocks.codes(reference)
    assert torch.equal(codes, torch.from_numpy(_q4_1_nibbles(raw, rows)))  # the file's own codes
    assert torch.equal(blocks.dequantize(codes), reference)  # bit-exact, float32
    # the int4 weight holds those codes and scales; its kernel computes (q - 8) * d + (m + 8 d)
    w = quantize_int4(reference, blocks, Int4Options(dense_copy=False))
    assert torch.equal(w.codes(torch.arange(rows)), codes)
    assert torch.equal(w.scales_and_zeros[..., 0].t(), blocks.scale)
    through_kernel = w.linear(torch.eye(cols), None).t()
    assert (through_kernel - reference).abs().max() <= 1e-6 * reference.abs().max()


def test_converted_default_model_keeps_q4_1_codes_after_the_rotary_unpermute(default_model_dir):
    """The q projection's rows are permuted back from llama.cpp's order: its block scales must
    follow them, so the int4 codes of the loaded layer are the file's codes, rows unpermuted."""
    scales = load_block_scales(default_model_dir)
    kinds = {}
    for b in scales.values():
        kinds[b.kind] = kinds.get(b.kind, 0) + 1
    assert kinds == {"q4_1": 210, "q8_0": 1}  # 30 layers x 7 projections; the tied embedding is Q8_0
    t = _gguf_tensor("blk.0.attn_q.weight")
    rows = int(t.shape.tolist()[1])
    file_codes = _q4_1_nibbles(t.data.view(np.ndarray), rows)
    expected = gguf_loading.unpermute_rotary_rows(file_codes, 9)
    dense = dict(loader.iter_safetensors(default_model_dir))["model.layers.0.self_attn.q_proj.weight"]
    got = scales["model.layers.0.self_attn.q_proj.weight"].codes(dense)
    assert torch.equal(got, torch.from_numpy(expected))


@pytest.mark.parametrize("dense_copy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_and_int8_products_match_their_dequantized_weights(dense_copy, dtype):
    torch.manual_seed(0)
    weight = (torch.randn(128, 96) * 0.05).to(dtype)
    codes, scale, offset = int4_group_codes(weight, 32)
    by_hand = (scale.repeat_interleave(32, 1) * codes + offset.repeat_interleave(32, 1))  # float32
    # min/max quantization: every weight within half a step of its code
    assert ((by_hand - weight.float()).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()
    int8_scale = weight.float().abs().amax(1, keepdim=True) / 127
    int8_by_hand = torch.round(weight.float() / int8_scale).clamp(-127, 127) * int8_scale
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for q, ref in [(quantize_int4(weight, None, Int4Options(dense_copy=dense_copy)), by_hand),
                   (quantize_int8(weight, None, WeightOnlyOptions(dense_copy=dense_copy)), int8_by_hand)]:
        assert (q.dequantize().float() - ref).abs().max() <= tol * ref.abs().max()
        ids = torch.tensor([0, 33, 64, 127, 5])
        assert torch.equal(q.embedding(ids), q.dequantize()[ids])
        if dense_copy and q.dense is not None:  # float32 keeps it unpacked: it is exactly the weight dequantized
            assert torch.equal(q.dense, q.dequantize())
        bias = torch.randn(128).to(dtype)
        for rows in (1, 2, 7):  # 7 > quantized_max_rows: the dense copy when there is one
            x = torch.randn(rows, 96).to(dtype)
            expected = x.float() @ ref.t() + bias.float()
            out = q.linear(x, bias)
            assert out.dtype == dtype and out.shape == (rows, 128)
            assert (out.float() - expected).abs().max() <= tol * 4 * expected.abs().max()
    # int4's dense copy is made from the codes at hand: the same values as reading them back packed
    q = quantize_int4(weight, None, Int4Options(dense_copy=False))
    assert torch.equal(q._dequantize_codes(codes, *q.scale_zero(torch.arange(128))), q.dequantize())


def test_int4_leaves_shapes_its_layout_cannot_hold_dense():
    assert quantize_int4(torch.randn(96, 64), None, None) is None  # rows not a multiple of 64
    assert quantize_int4(torch.randn(64, 48), None, None) is None  # inputs not a multiple of 32


def test_auto_choice_and_errors(default_model_dir):
    from paged.core.config import ModelConfig
    from paged.core.errors import ConfigError

    registry = get_registry()
    assert {"gguf", "int8", "int4"} <= set(registry.quantization_methods)
    cpu = torch.device("cpu")
    # gguf keeps every block kind as stored: auto picks it for any GGUF
    assert choose_auto(registry.quantization_methods, {"q4_1": 210, "q8_0": 1}, cpu, torch.bfloat16) == "gguf"
    assert choose_auto(registry.quantization_methods, {"q6_k": 3}, cpu, torch.bfloat16) == "gguf"
    without_gguf = {n: s for n, s in registry.quantization_methods.items() if n != "gguf"}
    assert choose_auto(without_gguf, {"q4_1": 210, "q8_0": 1}, cpu, torch.bfloat16) == "int4"
    assert choose_auto(without_gguf, {"q8_0": 3}, cpu, torch.bfloat16) == "int8"
    assert choose_auto(registry.quantization_methods, {}, cpu, torch.bfloat16) == "none"
    auto = make_quantizer(ModelConfig(), registry, default_model_dir, cpu, torch.bfloat16)
    assert auto.default == "gguf" and set(auto.methods) == {"gguf"}
    assert make_quantizer(ModelConfig(), registry, default_model_dir, cpu, torch.float32) is None
    assert make_quantizer(ModelConfig(quantization="none"), registry, default_model_dir, cpu, torch.bfloat16) is None
    with pytest.raises(ConfigError, match=r"model.quantization: unknown value 'int3'.*int4"):
        make_quantizer(ModelConfig(quantization="int3"), registry, default_model_dir, cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"model.quantization_options.group_size.*48"):
        make_quantizer(ModelConfig(quantization="int4", quantization_options={"group_size": 48}),
                       registry, default_model_dir, cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="cannot run here"):
        make_quantizer(ModelConfig(quantization="int4"), registry, default_model_dir, torch.device("meta"), torch.bfloat16)


def test_dtype_auto_follows_the_cpu_flags():
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    else:
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    native = bool(flags & {"amx_bf16", "avx512_bf16"})
    assert loader.get_dtype("auto", object(), "cpu") == (torch.bfloat16 if native else torch.float32)
    assert loader.get_dtype("float32", object(), "cpu") == torch.float32


@pytest.mark.slow
def test_default_model_int4_weights_within_1_3x_of_the_gguf(default_model_dir):
    from paged import LLM

    llm = LLM(default_model_dir, device="cpu", dtype="bfloat16", quantization="int4",
              quantization_options={"dense_copy": False}, num_kv_blocks=8)
    model = llm.engine.core.runner.model
    held = llm.engine.core.runner.weight_bytes
    # independently: int4 codes (half a byte per weight) + bf16 scale and zero per 32 weights
    # for every linear weight and the (tied) embedding, plus the bf16 norms
    params = {id(p): p for p in model.parameters()}
    norms = sum(p.numel() for p in params.values() if p.dim() == 1 and p.numel() > 0) * 2
    cfg = llm.engine.core.model_config.hf_config
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qkv = h + 2 * cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    weights = L * (qkv * h + h * h + 2 * i * h + h * i) + cfg.vocab_size * h
    assert held == norms + weights // 2 + weights // 32 * 4
    assert held <= 1.3 * gguf_loading.default_gguf_path().stat().st_size


def _tiny_llama(tmp_path: Path, default_model_dir: str) -> str:
    """A random 2-layer Llama whose projections the int4 layout holds (multiples of 64)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(default_model_dir) / name).is_file():
            shutil.copy(Path(default_model_dir) / name, tmp_path / name)
    return str(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_engine_with_chunked_prefill_preemption_and_prefix_caching(method, tmp_path, default_model_dir):
    """The stressed engine (every prompt chunked, too few KV blocks so requests are preempted and
    recomputed, shared prefixes hitting the prefix cache) gives the same greedy tokens as each
    prompt run alone on the same quantized weights (float32 activations: no bf16 reassociation
    between batch shapes)."""
    from paged import LLM, SamplingParams

    model_dir = _tiny_llama(tmp_path, default_model_dir)
    rng = np.random.default_rng(1)
    shared = rng.integers(100, 4000, 24).tolist()
    prompts = [shared + rng.integers(100, 4000, n).tolist() for n in (5, 17, 30, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", attention="torch", quantization=method,
                  quantization_options={"dense_copy": False})
    alone = LLM(model_dir, **common, num_kv_blocks=64)
    assert alone.engine.core.runner.quantizer.counts == {method: 2 * 4 + 1}
    expected = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    stressed = LLM(model_dir, **common, num_kv_blocks=12, block_size=8, max_num_batched_tokens=16,
                   long_prefill_token_threshold=7, enable_prefix_caching=True)
    outs = stressed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    # and the quantized model is close to the dense one: the same first greedy token
    dense = LLM(model_dir, **{**common, "quantization": "none"}, num_kv_blocks=64)
    firsts = [dense.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
              for p in prompts]
    assert sum(f == e[0] for f, e in zip(firsts, expected)) >= 3


# ---- the packed-weight cache ------------------------------------------------------------------

class _Slice:  # what paged.models.layers.CheckpointSlice tells the cache about a weight
    dim, dest_start, src_start = 0, 0, 0

    def __init__(self, length: int) -> None:
        self.length = length


@pytest.mark.parametrize("method,options", [("int4", Int4Options()), ("int4", Int4Options(dense_copy=False)),
                                            ("int4", Int4Options(avx512_kernel=False)), ("int8", WeightOnlyOptions())])
def test_a_cached_weight_is_read_back_as_it_was_quantized(method, options, tmp_path):
    from paged.core.loading.quantize import Quantizer

    spec = get_registry().quantization_method(method)
    torch.manual_seed(0)
    weight = (torch.randn(128, 96) * 0.05).to(torch.bfloat16)
    slices = {"model.layers.0.mlp.down_proj.weight": _Slice(128)}

    first = Quantizer({method: (spec, options)}, method, {}, tmp_path)
    made = first(weight, slices)
    assert first.cache_hits == 0 and len(list(tmp_path.glob("*.safetensors"))) == 1
    second = Quantizer({method: (spec, options)}, method, {}, tmp_path)
    read = second(torch.empty_like(weight), slices)  # the values are not looked at on a hit
    assert second.cache_hits == 1 and second.counts == {method: 1} and type(read) is type(made)
    assert torch.equal(read.dequantize(), made.dequantize())
    for rows in (1, 2, 7):  # the quantized kernel, and the dense copy where there is one
        x = torch.randn(rows, 96).to(torch.bfloat16)
        assert torch.equal(read.linear(x, None), made.linear(x, None))
    assert read.nbytes() == made.nbytes()


def test_a_cached_int4_weight_of_the_other_layout_is_quantized_again(tmp_path):
    from paged.core.loading.quantize import Quantizer
    from paged.plugins import quant_kernels

    if quant_kernels.load() is None:
        pytest.skip("one layout only here: torch's (no AVX-512 BF16 kernels)")
    spec = get_registry().quantization_method("int4")
    weight = (torch.randn(64, 64) * 0.05).to(torch.bfloat16)
    slices = {"w": _Slice(64)}
    Quantizer({"int4": (spec, Int4Options())}, "int4", {}, tmp_path)(weight, slices)  # paged's layout
    other = Quantizer({"int4": (spec, Int4Options(avx512_kernel=False))}, "int4", {}, tmp_path)
    q = other(weight, slices)
    assert other.cache_hits == 0 and q.kernel is None and q.scales_and_zeros is not None


def test_the_cache_folder_follows_the_options_and_can_be_turned_off(default_model_dir, monkeypatch):
    from paged.core.loading.quantize import CACHE_ENV, cache_folder

    spec = get_registry().quantization_method("int4")
    cpu = torch.device("cpu")
    a = cache_folder(default_model_dir, {"int4": (spec, Int4Options())}, torch.bfloat16, cpu)
    b = cache_folder(default_model_dir, {"int4": (spec, Int4Options(group_size=64))}, torch.bfloat16, cpu)
    assert a is not None and b is not None and a != b and a.parent == b.parent
    assert a.parent == Path(default_model_dir).resolve() / "quantized"  # beside the converted GGUF
    assert cache_folder(default_model_dir, {"int4": (spec, Int4Options())}, torch.float32, cpu) != a
    monkeypatch.setenv(CACHE_ENV, "0")
    assert cache_folder(default_model_dir, {"int4": (spec, Int4Options())}, torch.bfloat16, cpu) is None


def test_a_cached_gguf_weight_is_read_back_without_stacking_its_block_scales(tmp_path, monkeypatch):
    """A fused weight (q and k parts, each with its GGUF blocks) quantized once is read back on
    the next start before its scales are assembled (``BlockScales.stack``: most of a warm
    start's quantize time), and gives the same products as the weight made from the blocks."""
    from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks

    from paged.core.loading.quantize import Quantizer
    from paged.core.quantization import BlockScales

    class _Part:
        dim, src_start = 0, 0

        def __init__(self, dest_start: int, length: int) -> None:
            self.dest_start, self.length = dest_start, length

    kind, cols = "q4_k", 256
    scales, dense = {}, []
    for i, name in enumerate(("q_proj.weight", "k_proj.weight")):
        blocks = random_blocks(kind, 32, cols, seed=i)
        scales[name] = block_scales(blocks, kind, 32, cols)
        dense.append(torch.from_numpy(gguf_dequantized(blocks, kind, 32, cols)))
    weight = torch.cat(dense).to(torch.bfloat16)
    slices = {"q_proj.weight": _Part(0, 32), "k_proj.weight": _Part(32, 32)}
    spec = get_registry().quantization_method("gguf")
    methods = {"gguf": (spec, spec.options())}

    made = Quantizer(methods, None, scales, tmp_path)(weight, slices)
    assert made is not None
    monkeypatch.setattr(BlockScales, "stack", staticmethod(lambda *a: pytest.fail("stacked on a cache hit")))
    second = Quantizer(methods, None, scales, tmp_path)
    read = second(torch.empty_like(weight), slices)
    assert second.cache_hits == 1 and second.counts == {"gguf": 1}
    x = torch.randn(3, cols).to(torch.bfloat16)
    assert torch.equal(read.linear(x, None), made.linear(x, None))
    reference = x.double() @ torch.cat(dense).double().T  # gguf's own dequantization, float64
    assert torch.allclose(read.linear(x, None).double(), reference, rtol=0.02, atol=0.02)
