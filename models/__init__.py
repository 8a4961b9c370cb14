"""Model architectures and their shared layers (the README's "Models" table).

- ``layers``: RMSNorm, the gated MLP (SiLU or GeGLU), and the paged ``Attention`` wrapper that
  always goes through the selected attention backend (with a layer's ``AttentionSettings``).
- ``rotary``: rotary embeddings and their scalings (llama3, linear, dynamic, yarn, longrope,
  partial rotary).
- ``llama`` / ``qwen2`` / ``qwen3`` / ``mistral`` / ``phi3`` / ``gemma2`` / ``gemma3``: dense
  decoders, most of them Llama's modules with their own options (``llama``'s hooks);
  ``moe`` (``FusedMoE``, the router) with ``sparse_decoder`` and ``qwen2_moe`` / ``mixtral`` /
  ``qwen3_moe``: sparse mixture-of-experts decoders.
- ``cpu_layer_ops``: fused C++ CPU ops (norms, activations) the layers call when built.
Each architecture is a class built as ``cls(hf_config, backend, dtype, device)`` with
``load_weights``, ``forward(input_ids, positions, kv_caches, attn_metadata)`` and
``compute_logits``. Weight loading and GGUF conversion are architecture-independent and live in
``paged.core.loading``.
"""
