"""Model loading, independent of the architecture: config resolution, safetensors, GGUF."""
