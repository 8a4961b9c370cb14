"""LoRA adapters end to end (offline engine), against HF transformers with each adapter merged
into the base weights (PEFT's ``merge_and_unload``), greedy in float32.

Adapters are made by PEFT on a tiny random Llama: ``a`` on all seven projections (rank 8), ``b``
on q and v only with rsLoRA, a per-module rank (``rank_pattern``) and alpha (``alpha_pattern``).
Prompts of the base model and of both adapters run in the same steps, under chunked prefill,
preemption and the prefix cache; the prefix cache never shares blocks across adapters; bad
adapters are refused when named, with the file and field, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from paged import LLM, LoRARequest, SamplingParams
from paged.core.errors import InvalidRequestError

from helpers.lora_adapters import ALL_TARGETS, hf_greedy, save_adapter, save_base

NEW_TOKENS = 12
PROMPTS = [  # 21, 14 and 9 tokens: several 4-token blocks, chunked under an 8-token budget
    [1, 504, 3575, 282, 4649, 314, 1021, 3575, 282, 4649, 314, 1021, 504, 3575, 88, 99, 1000, 20, 30, 40, 50],
    [1, 9906, 11, 856, 836, 374, 3575, 282, 4649, 314, 1021, 77, 78, 79],
    [1, 1014, 2000, 3000, 4000, 5000, 6000, 7000, 8000],
]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, default_model_dir):
    """(base dir, {"a": LoRARequest, "b": LoRARequest}, HF greedy ids per (model, prompt index))."""
    import transformers

    root = tmp_path_factory.mktemp("lora")
    base_dir = save_base(root / "base", default_model_dir)
    merged = {
        "a": save_adapter(base_dir, root / "a", 1, r=8, lora_alpha=16, target_modules=ALL_TARGETS),
        "b": save_adapter(base_dir, root / "b", 2, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                          rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 5}),
        None: transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval(),
    }
    requests = {"a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    expected = {(name, i): hf_greedy(model, p, NEW_TOKENS) for name, model in merged.items() for i, p in enumerate(PROMPTS)}
    return base_dir, requests, expected


def greedy(max_tokens=NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(base_dir, **settings) -> LLM:
    settings = {"dtype": "float32", "quantization": "none", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                **settings}
    return LLM(str(base_dir), **settings)


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_mixed_steps_equal_hf_with_each_adapter_merged(lora_setup):
    """Every prompt under the base, a and b in one call: 8-token steps (chunked prefill), 4-token
    blocks, 16 of them (preemption), the prefix cache on; each request's tokens are HF's."""
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=6)
    steps = []
    llm.engine.core.schedule_observers.append(lambda out: steps.append({s.request.lora_int_id for s in out.scheduled}))
    names = [None, "a", "b"] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    outs = llm.generate(prompts, greedy(), lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == expected[(name, i // 3)], (name, i // 3)
    assert max(len(ids) for ids in steps) == 3  # base, a and b in one step
    assert llm.engine.core.stats.num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_one_slot_runs_one_adapter_per_step(lora_setup, kernel):
    """max_loras 1: the scheduler never puts a and b in the same step (b's requests wait), and the
    slot is reloaded as they alternate; both kernels give HF's tokens."""
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir, max_loras=1, lora_kernel=kernel)
    steps = []
    llm.engine.core.schedule_observers.append(lambda out: steps.append({s.request.lora_int_id for s in out.scheduled}))
    names = ["a", "b", None, "b", "a"]
    outs = llm.generate([PROMPTS[0]] * 5, greedy(), lora_request=[loras[n] if n else None for n in names],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[(n, 0)] for n in names]
    assert all(len(ids - {0}) <= 1 for ids in steps)
    assert any(1 in ids for ids in steps) and any(2 in ids for ids in steps)
    assert any(0 in ids and len(ids) == 2 for ids in steps)  # the base runs beside an adapter


def test_prefix_cache_is_never_shared_across_adapters(lora_setup):
    base_dir, loras, _ = lora_setup
    llm = make_llm(base_dir, block_size=4)
    prompt = PROMPTS[0]  # 5 full blocks

    def cached(lora):
        [out] = llm.generate(prompt, greedy(2), lora_request=lora, use_tqdm=False)
        return out.metrics.num_cached_tokens

    assert cached(loras["a"]) == 0
    assert cached(loras["a"]) == 20  # the same adapter: its 5 blocks
    assert cached(loras["b"]) == 0
    assert cached(None) == 0
    assert cached(None) == 20
    assert cached(loras["b"]) == 20


def test_adapters_beyond_memory_are_read_again(lora_setup):
    """max_cpu_loras 1 with two adapters: the one not in use is dropped and read again when named."""
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.core.lora
    for name in ["a", "b", "a", "b"]:
        [out] = llm.generate(PROMPTS[1], greedy(), lora_request=loras[name], use_tqdm=False)
        assert out.outputs[0].token_ids == expected[(name, 1)]
        assert list(manager.adapters) == [loras[name].lora_int_id]
    both = llm.generate([PROMPTS[1]] * 2, greedy(), lora_request=[loras["a"], loras["b"]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both] == [expected[("a", 1)], expected[("b", 1)]]


def test_unload_while_requests_run_finishes_them_then_drops_the_adapter(lora_setup):
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir)
    engine = llm.engine
    manager = engine.core.lora
    ids = [engine.add_request(None, PROMPTS[i], greedy(), lora_request=loras["a"]) for i in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.remove_lora(loras["a"].lora_int_id)
    assert loras["a"].lora_int_id in manager.adapters  # its requests still run
    assert [r.lora_name for r in engine.list_loras()] == []
    outs = engine.run_until_finished(ids)
    assert [o.outputs[0].token_ids for o in outs] == [expected[("a", i)] for i in range(3)]
    engine.add_request(None, PROMPTS[0], greedy(1))  # a step after the last one ended drops it
    engine.run_until_finished(["3"])
    assert loras["a"].lora_int_id not in manager.adapters
    assert loras["a"].lora_int_id not in manager.slot_of
    assert_all_blocks_free(llm)
    # named again, it is read again
    [out] = llm.generate(PROMPTS[2], greedy(), lora_request=loras["a"], use_tqdm=False)
    assert out.outputs[0].token_ids == expected[("a", 2)]


def _broken(tmp_path, source, name, change) -> LoRARequest:
    path = tmp_path / name
    shutil.copytree(source, path)
    change(path)
    return LoRARequest(name, 50, str(path))


def _edit_config(**fields):
    def change(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(fields)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return change


def _edit_tensors(edit):
    def change(path):
        tensors = load_file(path / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, path / "adapter_model.safetensors")
    return change


def _rename_module(old, new):
    def edit(tensors):
        for key in [k for k in tensors if k.startswith(old)]:
            tensors[new + key[len(old):]] = tensors.pop(key)
    return edit


BROKEN = {  # name: (how the adapter is broken, what the error names)
    "no-config": (lambda p: (p / "adapter_config.json").unlink(), ["adapter_config.json", "missing"]),
    "pickle-only": (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
                    ["adapter_model.safetensors", "adapter_model.bin is a pickle"]),
    "modules-to-save": (_edit_config(modules_to_save=["lm_head"]), ["field modules_to_save", "'lm_head'"]),
    "dora": (_edit_config(use_dora=True), ["field use_dora", "DoRA"]),
    "rank-too-big": (_edit_config(r=16), ["rank 8 differs", "(16)"]),
    "unknown-module": (_edit_tensors(_rename_module("base_model.model.model.layers.0.self_attn.q_proj",
                                                    "base_model.model.model.layers.0.self_attn.rotary")),
                       ["field target_modules", "'rotary'", "q_proj"]),
    "missing-b": (_edit_tensors(lambda t: t.pop(next(k for k in sorted(t) if k.endswith("lora_B.weight")))),
                  ["lora_B.weight", "missing"]),
    "shape": (_edit_tensors(lambda t: t.update({k: v[:, :32].contiguous() for k, v in t.items()
                                                 if k.endswith("q_proj.lora_A.weight")})),
              ["lora_A (8, 32)", "expected lora_A [r, 64]"]),
    "embedding": (_edit_tensors(lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 4)})),
                  ["embed_tokens.lora_embedding_A", "embedding adapter"]),
}


def test_bad_adapters_are_refused_when_named_and_the_engine_keeps_serving(lora_setup, tmp_path):
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir, max_lora_rank=8)
    source = loras["a"].lora_path
    for name, (change, words) in BROKEN.items():
        request = _broken(tmp_path, source, name, change)
        with pytest.raises(InvalidRequestError) as e:
            llm.engine.add_lora(request)
        message = str(e.value)
        assert f"LoRA adapter {name!r}" in message and request.lora_path in message
        assert all(w in message for w in words), (name, message)
        with pytest.raises(InvalidRequestError, match=f"LoRA adapter {name!r}"):  # named by a request: at add time
            llm.generate(PROMPTS[0], greedy(), lora_request=request, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="rank 8 exceeds lora.max_lora_rank \\(4\\)"):
        make_llm(base_dir, max_lora_rank=4).engine.add_lora(loras["a"])
    assert llm.engine.add_lora(loras["a"])
    with pytest.raises(InvalidRequestError, match="lora_int_id: 1 is already the id of adapter 'a'"):
        llm.engine.add_lora(LoRARequest("other", 1, loras["b"].lora_path))
    outs = llm.generate([PROMPTS[0]] * 2, greedy(), lora_request=[None, loras["a"]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[(None, 0)], expected[("a", 0)]]
    assert_all_blocks_free(llm)


def test_a_request_for_an_adapter_on_an_engine_without_lora_is_refused(lora_setup):
    base_dir, loras, expected = lora_setup
    llm = LLM(str(base_dir), dtype="float32", quantization="none")
    with pytest.raises(InvalidRequestError, match="lora_request: LoRA adapters are not enabled; start the engine with --enable-lora"):
        llm.generate(PROMPTS[0], greedy(), lora_request=loras["a"], use_tqdm=False)
    [out] = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == expected[(None, 0)]


def test_a_quantized_layer_adds_the_adapter_to_its_dequantized_weight(lora_setup):
    """bfloat16 with int4 base weights: a layer's output is x (W + s B A)^T for its dequantized W and
    PEFT's A, B and scaling (float64 reference), and the engine runs the adapter end to end."""
    base_dir, loras, expected = lora_setup
    llm = make_llm(base_dir, dtype="bfloat16", quantization="int4", quantization_options={"dense_copy": "false"})
    manager = llm.engine.core.lora
    module = llm.engine.core.runner.model.model.layers[1].mlp.down_proj
    assert module.qweight is not None
    manager.add(loras["a"])
    slots, loads = manager.prepare_step([loras["a"].lora_int_id])
    x = torch.randn(5, 128).to(torch.bfloat16)
    manager.begin_step(np.array([slots[0], slots[0], -1, slots[0], -1], dtype=np.int32), loads)
    try:
        y = module(x)
    finally:
        manager.end_step()
    tensors = load_file(f"{loras['a'].lora_path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    delta = tensors[f"{prefix}.lora_B.weight"].double() @ tensors[f"{prefix}.lora_A.weight"].double() * (16 / 8)
    w = module.qweight.dequantize().double()
    ref = x.double() @ (w + delta).T
    ref[[2, 4]] = x[[2, 4]].double() @ w.T
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)
    base, adapted = llm.generate([PROMPTS[1]] * 2, greedy(), lora_request=[None, loras["a"]], use_tqdm=False)
    alone = llm.generate(PROMPTS[1], greedy(), lora_request=loras["a"], use_tqdm=False)[0]
    assert adapted.outputs[0].token_ids == alone.outputs[0].token_ids != base.outputs[0].token_ids


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_hf(lora_setup):
    """Two ranks: column-parallel layers hold their rows of B, row-parallel ones their columns of A."""
    base_dir, loras, expected = lora_setup
    with make_llm(base_dir, tensor_parallel_size=2) as llm:
        names = [None, "a", "b", "b"]
        outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], greedy(),
                            lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected[(None, 0)], expected[("a", 1)],
                                                          expected[("b", 2)], expected[("b", 0)]]
