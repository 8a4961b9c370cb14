"""Structured-output (grammar) backends bundled with paged: xgrammar and llguidance."""
