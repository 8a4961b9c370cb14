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
