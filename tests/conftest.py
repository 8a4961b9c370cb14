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
    """Greedy continuations from HF transformers on the same weights, one prompt at a time
    (no padding), keyed by (prompt token ids, max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    cache = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                )
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return generate


# --- running on several workers (pytest-xdist; pyproject: -n auto --dist loadgroup) --------------
# A test file is one unit of work, so its module fixtures (a `paged serve`, a loaded model) are
# made once. The README's bash blocks, each a few cold starts and independent of the others, are
# one unit each. Units start slowest first (the order of SLOWEST_FIRST, then the rest) so that
# the workers finish together; with --no-loadscope-reorder xdist keeps this order.
SPREAD = {"tests/e2e/test_readme.py::test_readme_bash_block_runs"}
SLOWEST_FIRST = [  # seconds a unit took on its worker (`pytest -v`, both workers busy; rough: runs vary 2x)
    "tests/e2e/test_engine_parity.py",  # 100 (its HF reference included)
    "tests/core/engine/test_tensor_parallel.py",  # 100
    "tests/models/test_qwen3_mistral_phi3.py",  # 85
    "tests/core/engine/test_spec_decode.py",  # 85 (constrained requests on both grammar backends)
    "tests/e2e/test_moe_engine.py",  # 70
    "tests/e2e/test_nodes.py",  # 70: two-node launches
    "tests/e2e/test_readme.py::test_readme_bash_block_runs[paged-15]",  # 37, the lab block (ids count the blocks: renumber when one is added above it)
    "tests/e2e/test_readme.py",  # 65: the Python blocks and the inline commands
    "tests/core/server/test_server.py",  # 65
    "tests/core/engine/test_pooling.py",  # 65 (alone: 88 with another worker's suite running)
    "tests/core/server/test_server_dp.py",  # 60
    "tests/core/server/test_bad_input.py",  # 57
    "tests/core/server/test_structured.py",  # 45
    "tests/core/server/test_embeddings_server.py",  # 45
    "tests/core/server/test_prompt_logprobs_server.py",  # 35
    "tests/core/server/test_classify_server.py",  # 25
    "tests/e2e/test_lora.py",  # 30
    "tests/core/server/test_lora_server.py",  # 25
    "tests/e2e/test_plugin_contracts.py",  # 40
    "tests/core/test_structured_output.py",  # 40
    "tests/core/engine/test_kv_cache_stateful.py",  # 38
    "tests/e2e/test_readme_plugins.py",  # 37
    "tests/core/server/test_supervision.py",  # 26
    "tests/models/test_gemma.py",  # 26
    "tests/e2e/test_readme.py::test_readme_bash_block_runs",  # 8-21 each, the other bash blocks
    "tests/core/loading/test_gguf.py",  # 20
    "tests/core/frontend/test_llm.py",  # 20
    "tests/plugins/test_quantization.py",  # 18
    "tests/e2e/test_gpt2_plugin.py",  # 17
    "tests/core/engine/test_prompt_logprobs.py",  # 17
    "tests/core/engine/test_classification_head.py",  # 17
    "tests/core/server/test_spec_decode_server.py",  # 16
    "tests/core/test_registry.py",  # 15
    "tests/core/engine/test_compiled_step.py",  # 15
    "tests/backends/test_triton_attention.py",  # 14
    "tests/core/lab/test_lab.py",  # 14
    "tests/e2e/test_policy_server.py",  # 14
    "tests/core/server/test_reasoning.py",  # 13
    "tests/core/engine/test_spec_decode_distribution.py",  # 12
    "tests/core/frontend/test_tools.py",  # 11
    "tests/e2e/test_gguf_quantized.py",  # 11
    "tests/test_suite_setup.py",  # 10
    "tests/models/test_cpu_kernels.py",  # 9
    "tests/core/loading/test_config_snapshot.py",  # 9
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
