"""Front-ends: input/output processing (``processor``), the per-request state outputs are built
from (``request_state``), the streams the asynchronous front-end hands them to (``stream``),
detokenizer, LLMEngine, LLM, AsyncLLM, DP routing."""
