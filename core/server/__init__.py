"""The OpenAI-compatible HTTP server, by concern: ``protocol`` (request bodies), ``errors``
(OpenAI error shapes), ``metrics`` (Prometheus), ``streaming`` (SSE, logprob formatting, stream
plumbing), ``generation`` (the request lifecycle shared by the endpoints), ``completions`` and
``chat`` (the endpoints), ``state`` (what handlers share), ``app`` (routes, auth) and ``runner``
(uvicorn: ``run_server``, also importable from here)."""


def __getattr__(name: str):
    if name == "run_server":  # imported on use: FastAPI and uvicorn load only to serve
        from paged.core.server.runner import run_server

        return run_server
    raise AttributeError(name)
