"""Paged-attention backends (each: metadata builder + KV write + attention forward)."""
