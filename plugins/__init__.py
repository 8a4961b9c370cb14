"""Bundled plugins. Each module is named by an entry point of the ``paged`` group in
pyproject.toml, exactly as a third-party plugin would be."""
