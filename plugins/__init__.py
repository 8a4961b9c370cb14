"""Bundled plugins, loaded as a third-party plugin is: ``policies``, ``attention``, ``models``,
``structured_output`` and ``quantization`` are the entry points of the ``paged`` group in
pyproject.toml. The other modules serve them: ``srpt``, ``fair``, ``cache_aware`` and ``slo`` are
research policies that ``policies`` registers; ``quant_kernels`` and ``gguf_kernels`` build and
load the C++ GEMMs that ``quantization`` and ``gguf_quantization`` (registered by ``quantization``) call."""
