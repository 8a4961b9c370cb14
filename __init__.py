"""paged: a plugin-first LLM inference engine.

The offline API lives here; everything else is under ``paged.core`` (contracts and mechanisms),
``paged.plugins`` (bundled plugins), ``paged.backends`` (attention) and ``paged.models``.
"""

__version__ = "0.1.0"

from paged.core.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from paged.core.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
