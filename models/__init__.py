"""Model architectures (Llama, Qwen2), and their shared layers.

- ``layers``: RMSNorm, rotary embedding (incl. Llama-3 scaling), gated SiLU MLP, and the paged
  ``Attention`` wrapper that always goes through the selected attention backend.
- ``llama`` / ``qwen2``: ``factory(hf_config, backend, dtype, device) -> nn.Module`` with
  ``load_weights``, ``forward(input_ids, positions, kv_caches, attn_metadata)`` and
  ``compute_logits``.
Weight loading and GGUF conversion are architecture-independent and live in ``paged.core.loading``.
"""
