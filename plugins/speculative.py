"""Bundled speculative-decoding proposers: ``ngram`` (prompt lookup, ``paged.plugins.ngram``)."""

from __future__ import annotations

from paged.core.hookspecs import SpeculativeProposerSpec, hookimpl
from paged.plugins.ngram import NgramOptions, NgramProposer


@hookimpl
def register_speculative_proposers():
    return [
        SpeculativeProposerSpec(
            name="ngram",
            factory=NgramProposer,
            options=NgramOptions,
            description="prompt lookup: the tokens that followed the latest earlier occurrence of the request's "
            "last 2-4 tokens (prompt_lookup_min/max)",
        ),
    ]
