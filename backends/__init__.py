"""What the bundled plugins (paged.plugins) register: the paged-attention backends ``torch``,
``triton`` and ``flashinfer`` (each: KV-cache allocation, per-step metadata, and a forward that
writes the step's K/V and attends; ``cpu_paged_decode`` is the torch one's C++ decode kernel) and
the structured-output backends ``llguidance`` and ``xgrammar``."""
