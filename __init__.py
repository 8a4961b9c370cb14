"""paged: a plugin-first LLM inference engine.

The offline API lives here; everything else is under ``paged.core`` (contracts and mechanisms),
``paged.plugins`` (bundled plugins), ``paged.backends`` (attention) and ``paged.models``.
"""

__version__ = "0.1.0"

from paged.core.lora import LoRARequest  # noqa: E402
from paged.core.pooling_params import PoolingParams  # noqa: E402
from paged.core.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch, transformers and the model code: imported only when asked for, so that
    # `import paged` (and SamplingParams) import no torch (tests/core/test_startup.py checks it).
    if name == "LLM":
        from paged.core.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
