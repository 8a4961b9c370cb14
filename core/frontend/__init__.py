"""Front-ends: input/output processing, detokenizer, LLMEngine, LLM, AsyncLLM, DP routing."""
