"""The C++ CPU kernels built by ``paged.core.native``: fused layer ops (``paged.models.cpu_layer_ops``),
the KV write (``paged.backends.cpu_paged_decode``) and the int4 GEMM (``paged.plugins.quant_kernels``),
each against an independent reference: the eager chain of torch ops it replaces, ``index_copy_``,
and a float32 matmul with the weight dequantized by hand."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from paged.backends import cpu_paged_decode
from paged.core import native
from paged.models import cpu_layer_ops
from paged.models.layers import GatedMLP, RMSNorm
from paged.models.rotary import RotaryEmbedding
from paged.plugins import quant_kernels
from paged.plugins.quantization import Int4Options, Int4Weight, Int8Weight, WeightOnlyOptions, int4_group_codes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    module = cpu_layer_ops.load()
    assert module is not None, "the CPU layer kernels did not build (a C++ compiler and ninja are dependencies)"
    return module


def _eager_norm(x, residual, weight, eps):
    """paged.models.layers.RMSNorm's torch ops, written out."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed, x


def _eager_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 37])  # 37 > the kernels' 16-row grain: two threads
def test_layer_ops_return_the_eager_values(ops, dtype, tokens):
    torch.manual_seed(tokens)
    hidden, heads, kv_heads, head_dim, inter = 200, 5, 1, 64, 328  # sizes off the 16-lane vectors
    weight = torch.randn(hidden).to(dtype)
    x = (torch.randn(tokens, hidden) * 3).to(dtype)
    residual = torch.randn(tokens, hidden).to(dtype)
    def check(got, want):
        """The eager values; the norm's fp32 sum of squares is taken in another order, so a value
        on a rounding boundary of a 16-bit dtype may move by one unit (rarely)."""
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            assert (got != want).float().mean() < 0.005
            torch.testing.assert_close(got, want, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=0)

    check(ops.rms_norm(x, weight, 1e-5), _eager_norm(x, None, weight, 1e-5)[0])
    got, summed = ops.add_rms_norm(x, residual, weight, 1e-5)
    want, want_sum = _eager_norm(x, residual, weight, 1e-5)
    check(got, want)
    assert torch.equal(summed, want_sum)
    # a Qwen3-style per-head norm: [T, heads, head_dim]
    per_head = torch.randn(tokens, heads, head_dim).to(dtype)
    head_weight = torch.randn(head_dim).to(dtype)
    check(ops.rms_norm(per_head, head_weight, 1e-6), _eager_norm(per_head, None, head_weight, 1e-6)[0])

    # rotary on strided views of a fused QKV projection, as the Attention layer passes them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,)), dtype)
    got_q, got_k = ops.rotary(q, k, cos, sin)
    assert torch.equal(got_q, _eager_rotary(q, cos, sin)) and torch.equal(got_k, _eager_rotary(k, cos, sin))

    gate_up = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:  # exp within 2 ulp of fp32: a rounding boundary may move one value by one unit
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


def test_silu_and_mul_edge_values(ops):
    gate = torch.tensor([-1e4, -100.0, -88.0, -1e-30, 0.0, 1e-30, 3.0, 88.0, 100.0, 1e4,
                         float("inf"), float("-inf"), float("nan"), -3.0, 0.5, 20.0])
    up = torch.linspace(-2, 2, 16)
    for dtype in DTYPES:
        x = torch.cat([gate, up]).to(dtype).unsqueeze(0)
        want = F.silu(x[:, :16]) * x[:, 16:]
        got = ops.silu_and_mul(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30, equal_nan=True)


def test_layer_ops_name_the_bad_argument(ops):
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm: residual must match x"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul: x must be float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.int32))


def test_layers_take_the_fused_path_and_the_torch_path_alike(ops, monkeypatch):
    """The modules with the kernels and without them (a machine where the build failed)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    norm = RMSNorm(64, 1e-5, dtype=dtype, device="cpu")
    norm.weight.data.normal_()
    mlp = GatedMLP(64, 96, dtype=dtype, device="cpu")
    for p in mlp.parameters():
        p.data.normal_(std=0.1)
    rope = RotaryEmbedding(32, 512, 10000.0)
    x, residual = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
    q, k = torch.randn(3, 2, 32).to(dtype), torch.randn(3, 1, 32).to(dtype)
    positions = torch.tensor([0, 7, 300])

    def run():
        return [norm(x), *norm(x, residual), mlp(x), *rope(positions, q, k)]

    fused = run()
    calls = []
    monkeypatch.setattr(cpu_layer_ops, "load", lambda: calls.append(1))  # returns None: the torch ops
    plain = run()
    assert len(calls) == 4  # every module asked, and fell back
    for a, b in zip(fused, plain):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_failed_build_warns_once_and_the_layers_keep_their_torch_ops(monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(native, "build_and_load", fail)
    cpu_layer_ops.load.cache_clear()
    try:
        norm = RMSNorm(16, 1e-5, dtype=torch.float32, device="cpu")
        norm.weight.data.fill_(2.0)
        x = torch.randn(2, 16)
        with caplog.at_level(logging.WARNING, logger="paged.models.cpu_layer_ops"):
            for _ in range(3):
                torch.testing.assert_close(norm(x), _eager_norm(x, None, norm.weight, 1e-5)[0])
        assert [r.getMessage() for r in caplog.records] == [
            "CPU layer kernels unavailable, the layers run their torch ops instead: no compiler here"
        ]
    finally:
        cpu_layer_ops.load.cache_clear()


def test_layer_ops_are_not_used_on_request(monkeypatch):
    monkeypatch.setenv("PAGED_CPU_LAYER_OPS", "0")
    cpu_layer_ops.load.cache_clear()
    try:
        assert cpu_layer_ops.load() is None and cpu_layer_ops.enabled(torch.zeros(1)) is None
    finally:
        cpu_layer_ops.load.cache_clear()


# ---- KV write ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_index_copy(dtype):
    kernels = cpu_paged_decode.kernels()
    assert kernels is not None
    torch.manual_seed(1)
    blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 16, 7
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype)
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim).to(dtype)  # strided views, as the layer passes them
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([23, 0, 5, 6, 17, 12, 3])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, key)
    want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, value)
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match=r"write_kv: slot 24 of token 1 is outside the cache \(24 slots\)"):
        kernels.write_kv(key[:2], value[:2], k_cache, v_cache, torch.tensor([1, 24]))


# ---- int4 GEMM -------------------------------------------------------------------------------


needs_int4_kernel = pytest.mark.skipif(
    quant_kernels.load() is None, reason="this CPU has no AVX-512 BF16: int4/int8 keep torch's kernels (tested elsewhere)"
)


def _by_hand(codes, scale, zero, group_size):
    """``(code - 8) * scale + zero`` per group, float32, from bfloat16 scales and zeros."""
    n, k = codes.shape
    q = (codes.float() - 8).view(n, k // group_size, group_size)
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).view(n, k)


@needs_int4_kernel
@pytest.mark.parametrize("n,k,group_size", [(576, 576, 32), (13, 64, 32), (96, 1088, 64), (64, 256, 128)])
def test_int4_gemm_matches_a_float32_matmul_of_the_weight_dequantized_by_hand(n, k, group_size):
    gemm = quant_kernels.load().int4_gemm
    torch.manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = (torch.rand(n, k // group_size) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(n, k // group_size) * 0.05).to(torch.bfloat16)
    packed = quant_kernels.pack(codes, scale, zero, group_size)
    assert packed.shape == (n, k // 2 + 4 * (k // 32)) and torch.equal(quant_kernels.unpack(packed, k), codes)
    got_scale, got_zero = quant_kernels.scales_and_zeros(packed, k)
    repeat = group_size // 32
    assert torch.equal(got_scale[:, ::repeat], scale) and torch.equal(got_zero[:, ::repeat], zero)
    weight = _by_hand(codes, scale, zero, group_size)
    for rows in (1, 2, 3, 4, 5, 9):  # 1-4 in one pass, more in passes of four
        x = torch.randn(rows, k).to(torch.bfloat16)
        want = x.float() @ weight.t()
        got = gemm(x, packed)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # fp32 accumulation, one rounding to bfloat16 at the end
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3 * want.abs().max()).all()
    with pytest.raises(RuntimeError, match=r"int4_gemm: K \(96\) must be a multiple of 64"):
        gemm(torch.zeros(1, 96, dtype=torch.bfloat16), packed)


@needs_int4_kernel
def test_int4_weight_in_the_kernel_layout_holds_the_same_weight_as_in_torchs():
    torch.manual_seed(3)
    weight = (torch.randn(128, 192) * 0.05).to(torch.bfloat16)
    codes, scale, offset = int4_group_codes(weight, 32)
    ours = Int4Weight(codes, scale, offset, 32, torch.bfloat16, Int4Options(dense_copy=False))
    torchs = Int4Weight(codes, scale, offset, 32, torch.bfloat16, Int4Options(dense_copy=False, avx512_kernel=False))
    assert ours.kernel is not None and torchs.kernel is None
    ids = torch.tensor([0, 63, 64, 127, 5])
    assert torch.equal(ours.codes(ids), codes[ids]) and torch.equal(torchs.codes(ids), codes[ids])
    assert torch.equal(ours.dequantize(), torchs.dequantize())
    assert torch.equal(ours.embedding(ids), torchs.embedding(ids))
    x = torch.randn(2, 192).to(torch.bfloat16)
    want = x.float() @ ours.dequantize().float().t()
    for w in (ours, torchs):
        out = w.linear(x, None)
        assert (out.float() - want).abs().max() <= 2**-7 * want.abs().max()
    bias = torch.randn(128).to(torch.bfloat16)
    assert torch.allclose(ours.linear(x, bias).float(), want + bias.float(), rtol=2**-7, atol=2**-7 * want.abs().max())


@needs_int4_kernel
def test_int4_gemm_traces_under_torch_compile():
    """Compiled steps see the kernel as an opaque op with a fake implementation."""
    torch.manual_seed(4)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.int32)
    scale = (torch.rand(64, 4) * 0.02).to(torch.bfloat16)
    zero = (torch.randn(64, 4) * 0.05).to(torch.bfloat16)
    w = Int4Weight(codes, scale, scale * 0 + zero, 32, torch.bfloat16, Int4Options(dense_copy=False))
    x = torch.randn(1, 128).to(torch.bfloat16)
    compiled = torch.compile(lambda t: w.linear(t, None) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), w.linear(x, None) * 2, rtol=0, atol=0)


@needs_int4_kernel
@pytest.mark.parametrize("n,k", [(77, 576), (4, 32), (130, 1536)])
def test_int8_gemm_matches_a_float32_matmul_of_the_weight_dequantized_by_hand(n, k):
    gemm = quant_kernels.load().int8_gemm
    torch.manual_seed(n)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    codes[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)  # the ends of the range
    scale = (torch.rand(n) * 0.01 + 1e-4).to(torch.bfloat16)
    weight = codes.float() * scale.float().unsqueeze(1)
    for rows in (1, 2, 3, 5):
        x = (torch.randn(rows, k) + 0.5).to(torch.bfloat16)  # a mean: the offset terms do not cancel it away
        want = x.float() @ weight.t()
        got = gemm(x, codes, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3 * want.abs().max()).all()
    with pytest.raises(RuntimeError, match=r"int8_gemm: scale must be \[N\] bfloat16"):
        gemm(x, codes, scale.float())


@needs_int4_kernel
def test_int8_weight_with_and_without_the_kernel():
    torch.manual_seed(5)
    weight = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    ours = Int8Weight(weight, WeightOnlyOptions(dense_copy=False))
    torchs = Int8Weight(weight, WeightOnlyOptions(dense_copy=False, avx512_kernel=False))
    assert ours.kernel is not None and torchs.kernel is None
    assert torch.equal(ours.dequantize(), torchs.dequantize())
    x = torch.randn(2, 64).to(torch.bfloat16)
    want = x.float() @ ours.dequantize().float().t()
    for w in (ours, torchs):
        assert (w.linear(x, None).float() - want).abs().max() <= 2**-7 * want.abs().max()
    compiled = torch.compile(lambda t: ours.linear(t, None) + 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), ours.linear(x, None) + 1, rtol=0, atol=0)


def test_layers_keep_their_torch_ops_where_the_fused_ones_do_not_apply(ops):
    """Mixed dtypes, a broadcast residual, a 3-D MLP input, float64: what the torch ops accept."""
    torch.manual_seed(6)
    norm = RMSNorm(32, 1e-5, dtype=torch.bfloat16, device="cpu")
    norm.weight.data.normal_()
    x = torch.randn(3, 32).to(torch.bfloat16)
    for residual in (torch.randn(3, 32), torch.randn(1, 32).to(torch.bfloat16)):  # float32; broadcast
        got, summed = norm(x, residual)
        want, want_sum = _eager_norm(x, residual, norm.weight, 1e-5)
        assert torch.equal(got, want) and torch.equal(summed, want_sum)
    mlp = GatedMLP(32, 48, dtype=torch.bfloat16, device="cpu")
    for p in mlp.parameters():
        p.data.normal_(std=0.1)
    x3 = torch.randn(2, 3, 32).to(torch.bfloat16)
    assert mlp(x3).shape == (2, 3, 32)
    norm64 = RMSNorm(32, 1e-5, dtype=torch.float64, device="cpu")
    norm64.weight.data.fill_(1.0)
    x64 = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(norm64(x64), _eager_norm(x64, None, norm64.weight, 1e-5)[0])


# ---- one build per machine and torch version ------------------------------------------------

_NAMES = ("from paged.backends import cpu_paged_decode\nfrom paged.models import cpu_layer_ops\n"
          "from paged.plugins import quant_kernels\n"
          "print(cpu_paged_decode.build_name(), cpu_layer_ops.build_name(), quant_kernels.build_name())")


def test_every_caller_gets_the_same_build_name(tmp_path):
    """The name hashes what decides the library (sources, flags, torch, Python ABI, CPU), not who
    asks: another working directory, locale, hash seed, extensions root or kernel switch."""
    import os
    import subprocess
    import sys

    here = (cpu_paged_decode.build_name(), cpu_layer_ops.build_name(), quant_kernels.build_name())
    envs = [
        os.environ.copy(),
        dict(os.environ, LANG="C", LC_ALL="C", PYTHONHASHSEED="123", PAGED_CPU_LAYER_OPS="0",
             TORCH_EXTENSIONS_DIR=str(tmp_path)),
    ]
    for env in envs:
        out = subprocess.run([sys.executable, "-c", _NAMES], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, check=True)
        assert tuple(out.stdout.split()) == here
    assert len(set(here)) == 3 and all(name.startswith("paged_") for name in here)


def test_a_built_library_is_loaded_without_building(tmp_path):
    """A later process loads the build as it is: no load_inline, no ninja, the file untouched."""
    import os
    import subprocess
    import sys

    if cpu_layer_ops.load() is None:
        pytest.skip("the CPU layer kernels are not built here")
    path = native.library_path(cpu_layer_ops.build_name())
    before = os.stat(path).st_mtime_ns
    code = ("from torch.utils import cpp_extension\n"
            "def no_build(*a, **k):\n    raise AssertionError('built again')\n"
            "cpp_extension.load_inline = no_build\n"
            "from paged.models import cpu_layer_ops\nassert cpu_layer_ops.load() is not None")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=120, check=True)
    assert os.stat(path).st_mtime_ns == before


def test_the_build_root_is_torchs_and_loading_a_build_does_not_import_the_builder(tmp_path, monkeypatch):
    """``build_root`` is ``cpp_extension.get_default_build_root()`` (or $TORCH_EXTENSIONS_DIR),
    found without importing ``cpp_extension``: a process that loads a built library imports
    neither it nor setuptools."""
    import os
    import subprocess
    import sys

    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert native.build_root() == cpp_extension.get_default_build_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.library_path("x") == os.path.join(str(tmp_path), "x", "x.so")
    if cpu_layer_ops.load() is None:
        pytest.skip("the CPU layer kernels are not built here")
    code = ("import sys\nfrom paged.models import cpu_layer_ops\nassert cpu_layer_ops.load() is not None\n"
            "print(sorted(m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_library_that_does_not_load_is_built_again(tmp_path, monkeypatch, caplog):
    import os

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "paged_test_lib_0123"
    os.makedirs(tmp_path / name)
    (tmp_path / name / f"{name}.so").write_bytes(b"not a library")  # a build cut short
    built = []
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: built.append(k["build_directory"]) or "module")
    with caplog.at_level(logging.INFO, logger="paged.test"):
        assert native.build_and_load(name, "// nothing", [], "test kernels", logging.getLogger("paged.test")) == "module"
    assert built == [str(tmp_path / name)] and not (tmp_path / name / f"{name}.so").exists()
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot be loaded" in m for m in messages) and any(m.startswith("compiling the test kernels") for m in messages)


def test_the_setup_command_finds_the_builds(capsys):
    if cpu_layer_ops.load() is None:
        pytest.skip("the CPU layer kernels are not built here")
    assert native.main(["paged.models.cpu_layer_ops"]) == 0
    assert native.library_path(cpu_layer_ops.build_name()) in capsys.readouterr().err
    assert native.main([]) == 2
