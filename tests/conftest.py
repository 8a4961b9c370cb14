"""Shared fixtures: the embedded default model and an independent HF transformers reference."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# A test that needs the default model skips without it; under PAGED_REQUIRE_MODEL=1 (CI) it fails.
pytest_plugins = ["helpers.default_model"]


@pytest.fixture(scope="session")
def default_model_dir():
    from helpers.default_model import default_gguf
    from paged.core.loading.gguf import converted_model_dir

    return str(converted_model_dir(default_gguf()))


@pytest.fixture(scope="session")
def hf_greedy(default_model_dir):
    """HF transformers' greedy continuation of ``prompt_ids`` on the same weights (float32, one
    prompt at a time, no padding), as ``model.generate(max_new_tokens=..., do_sample=False)``
    gives it: up to ``max_new_tokens`` tokens, ending at the first EOS.

    ``candidate``, the tokens under test, makes it cheap: one forward over prompt + candidate
    (teacher forcing) instead of one per token. While the candidate's tokens are HF's argmax,
    HF's greedy continuation is the candidate; at the first token where they differ the result
    ends with HF's own token there, so it differs from the candidate exactly when generation would.
    Past a fully confirmed candidate that stopped early (not at EOS), HF generates the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    cache = {}

    def generate(prompt_ids: list[int], max_new_tokens: int, candidate: list[int] | None = None) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key in cache:
            return cache[key]
        expected: list[int] = []
        if candidate:
            candidate = list(candidate[:max_new_tokens])
            with torch.inference_mode():
                logits = model(torch.tensor([prompt_ids + candidate[:-1]])).logits[0]
            # HF's greedy token after the prompt and candidate[:i], for each i
            for token, hf_token in zip(candidate, logits[len(prompt_ids) - 1:].argmax(-1).tolist()):
                expected.append(hf_token)
                if hf_token in eos_ids or hf_token != token:
                    return expected  # HF's continuation ends here, or differs from the candidate here
        if len(expected) < max_new_tokens:  # no candidate, or a confirmed one that stopped early
            with torch.inference_mode():
                ids = prompt_ids + expected
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens - len(expected), do_sample=False, pad_token_id=0)
            expected += out[0, len(ids):].tolist()
        cache[key] = expected
        return expected

    return generate


# --- running on several workers (pytest-xdist; pyproject: -n auto --dist loadgroup) --------------
# A test file is one unit of work, so its module fixtures (a `paged serve`, a loaded model) are
# made once. The README's bash blocks, each a few cold starts and independent of the others, are
# one unit each. Units start slowest first (the order of SLOWEST_FIRST, then the rest) so that
# the workers finish together; with --no-loadscope-reorder xdist keeps this order.
SPREAD = {"tests/e2e/test_readme.py::test_readme_bash_block_runs"}
SLOWEST_FIRST = [  # seconds a unit took on its worker (`pytest --durations=0`, both workers busy; rough: runs vary 2x)
    "tests/core/engine/test_spec_decode.py",  # 126 (constrained requests on both grammar backends)
    "tests/e2e/test_nodes.py",  # 86: two-node launches
    "tests/e2e/test_readme.py",  # 79: the Python blocks and the inline commands
    "tests/core/engine/test_tensor_parallel.py",  # 57
    "tests/core/server/test_server.py",  # 49
    "tests/e2e/test_plugin_contracts.py",  # 46
    "tests/e2e/test_engine_parity.py",  # 44 (its HF reference included)
    "tests/core/engine/test_kv_cache_stateful.py",  # 42
    "tests/core/server/test_structured.py",  # 42
    "tests/models/test_qwen3_mistral_phi3.py",  # 40
    "tests/core/server/test_server_dp.py",  # 40
    "tests/e2e/test_readme_plugins.py",  # 39
    "tests/e2e/test_readme.py::test_readme_bash_block_runs[paged-15]",  # 36, the lab block (ids count the blocks: renumber when one is added above it)
    "tests/e2e/test_moe_engine.py",  # 35
    "tests/core/server/test_bad_input.py",  # 34
    "tests/core/test_structured_output.py",  # 24
    "tests/core/server/test_reasoning.py",  # 23
    "tests/models/test_gemma.py",  # 22
    "tests/core/loading/test_gguf.py",  # 21
    "tests/core/engine/test_pooling.py",  # 20
    "tests/core/server/test_spec_decode_server.py",  # 16
    "tests/e2e/test_gpt2_plugin.py",  # 16
    "tests/core/server/test_embeddings_server.py",  # 16
    "tests/core/server/test_classify_server.py",  # 16
    "tests/core/engine/test_spec_decode_distribution.py",  # 15
    "tests/core/lab/test_lab.py",  # 15
    "tests/e2e/test_lora.py",  # 15
    "tests/core/frontend/test_llm.py",  # 15
    "tests/core/test_registry.py",  # 14
    "tests/backends/test_triton_attention.py",  # 14
    "tests/e2e/test_readme.py::test_readme_bash_block_runs",  # up to 14 each, the other bash blocks
    "tests/core/server/test_prompt_logprobs_server.py",  # 14
    "tests/core/server/test_lora_server.py",  # 13
    "tests/plugins/test_quantization.py",  # 12
    "tests/core/engine/test_compiled_step.py",  # 12 (36 with a cold inductor cache)
    "tests/core/server/test_supervision.py",  # 11
    "tests/core/engine/test_prompt_logprobs.py",  # 9
    "tests/e2e/test_policy_server.py",  # 8
    "tests/core/engine/test_classification_head.py",  # 8
    "tests/core/frontend/test_tools.py",  # 7
    "tests/core/loading/test_config_snapshot.py",  # 7
    "tests/core/engine/test_sampler.py",  # 7
    "tests/core/test_config.py",  # 6
]


def _unit(nodeid: str) -> str:
    function = nodeid.split("[")[0]
    return nodeid if function in SPREAD else nodeid.split("::")[0]


def _rank(nodeid: str) -> int:
    """The place in SLOWEST_FIRST of the longest entry the node id starts with (a bash block's
    own entry before its function's, that before its file's)."""
    matches = [(len(prefix), i) for i, prefix in enumerate(SLOWEST_FIRST) if nodeid.startswith(prefix)]
    return max(matches)[1] if matches else len(SLOWEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item.nodeid)))
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: a file keeps its own order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, its units made by _unit from the node id. xdist (3.8) groups tests by an
    ``@group`` suffix it writes into ``item._nodeid``, which pytest 9 no longer reads (a node id
    is ``item._id``): without this every test was a unit of its own, and both workers built the
    module fixtures of most files (two `paged serve`s, two HF references, ...)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class UnitScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's suffix, where it works
                return super()._split_scope(nodeid)
            return _unit(nodeid)

    return UnitScheduling(config, log)


def pytest_configure(config):
    # Workers share the cores: torch in each uses its share, not all of them (OpenMP threads
    # spinning on a core another worker's thread needs slow both down many times over).
    # The environment carries the share to the processes the tests start (servers, engine cores,
    # `paged run`): with all the cores each, they made a served test 10x slower under xdist than alone.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, hypothesis, every test module: ~500,000
    # objects) lives as long as this process. Frozen, the collector stops walking all of it at
    # each full collection: test_kv_cache_stateful, test_scheduler and test_sampler run alone
    # took 12-18% less CPU; in the whole suite the workers' CPU stayed within noise (304 -> 298
    # s, two runs side by side). Objects made later are collected as before.
    import gc

    gc.collect()
    gc.freeze()
