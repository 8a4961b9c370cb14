"""Errors the user sees. Each message names the field, the bad value and what would be accepted."""


class PagedError(Exception):
    """Base class of every error paged raises on purpose."""


class ConfigError(PagedError, ValueError):
    """A setting is invalid (unknown key, bad value, unknown plugin name)."""


class PluginError(PagedError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class InvalidRequestError(PagedError, ValueError):
    """A request cannot be served as given (too long, bad sampling parameter)."""


class ModelLoadError(PagedError):
    """A model directory or checkpoint cannot be loaded."""


class RequestRejectedError(PagedError):
    """The scheduling policy's admission control turned a request away (overload, quota, a
    deadline it cannot meet). ``http_status`` is 429 or 503; the message is the policy's reason."""

    def __init__(self, message: str, http_status: int = 429) -> None:
        super().__init__(message)
        self.http_status = http_status


class EngineError(PagedError):
    """A plugin or the engine failed while serving. The message names who raised (kind, name and
    plugin), in which method, and the exception. Raised offline by ``LLM.generate``/``chat`` when
    a request ended with ``finish_reason == "error"`` (``outputs`` then holds every request's
    output, the failed ones included), or when the engine stopped (``outputs`` empty)."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []
