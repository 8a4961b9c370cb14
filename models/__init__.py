"""Model architectures (Llama, Qwen2), their shared layers and weight loading.

- ``layers``: RMSNorm, rotary embedding (incl. Llama-3 scaling), gated SiLU MLP, and the paged
  ``Attention`` wrapper that always goes through the selected attention backend.
- ``llama`` / ``qwen2``: ``factory(hf_config, backend, dtype, device) -> nn.Module`` with
  ``load_weights``, ``forward(input_ids, positions, kv_caches, attn_metadata)`` and
  ``compute_logits``.
- ``loader``: resolve a model directory (or ``.gguf`` file, or the embedded default), read its
  config, tokenizer and safetensors, pick the dtype, build the model.
- ``gguf``: convert a GGUF file into an ordinary HF directory (cached).
"""
