"""Bundled attention backends: ``torch`` (the PyTorch reference, every device), ``triton`` and
``flashinfer``.

``attention=auto`` takes the available one with the highest priority: flashinfer (20), then
triton (10), then torch (0). Loading this plugin imports the three backend modules
(paged.backends) but neither Triton nor FlashInfer: the availability checks only look for the
packages (``find_spec``), and each package is imported when the engine constructs its backend.
"""

from __future__ import annotations

from paged.backends import flashinfer_attention as _flashinfer
from paged.backends import triton_attention as _triton
from paged.backends.torch_attention import TorchAttentionBackend, TorchAttentionOptions
from paged.core.hookspecs import AttentionBackendSpec, hookimpl


def _triton_factory(layout, options=None):
    return _triton.TritonAttentionBackend(layout, options)


def _flashinfer_factory(layout, options=None):
    return _flashinfer.FlashInferAttentionBackend(layout, options)


@hookimpl
def register_attention_backends():
    return [
        AttentionBackendSpec(
            name="torch",
            factory=TorchAttentionBackend,
            options=TorchAttentionOptions,
            description="PyTorch reference: index_select gathers + scaled_dot_product_attention; any device "
            "(CPU decodes: a fused C++ paged-decode kernel, option cpu_decode_kernel)",
            is_available=lambda device: (True, ""),
            auto_priority=0,
        ),
        AttentionBackendSpec(
            name="triton",
            factory=_triton_factory,
            options=_triton.TritonAttentionOptions,
            description="Triton kernels: KV write + one paged attention kernel for decodes and prefill chunks; CUDA "
            "(CPU only under TRITON_INTERPRET=1)",
            is_available=_triton.is_available,
            auto_priority=10,
        ),
        AttentionBackendSpec(
            name="flashinfer",
            factory=_flashinfer_factory,
            options=_flashinfer.FlashInferOptions,
            description="FlashInfer batch decode / prefill wrappers over the paged cache; CUDA, fp16/bf16 "
            "(optional extra: paged[flashinfer])",
            is_available=_flashinfer.is_available,
            auto_priority=20,
        ),
    ]
