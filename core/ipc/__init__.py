"""The process boundary: wire messages, the engine-core process and its client (ZeroMQ + msgspec)."""
