"""Bundled speculative-decoding proposers: ``ngram`` (prompt lookup, ``paged.plugins.ngram``),
``suffix`` (suffix decoding, ``paged.plugins.suffix``) and ``draft_model`` (a smaller model with its
own KV cache, ``paged.plugins.draft_model``)."""

from __future__ import annotations

from paged.core.hookspecs import SpeculativeProposerSpec, hookimpl
from paged.plugins.draft_model import DraftModelOptions, DraftModelProposer
from paged.plugins.ngram import NgramOptions, NgramProposer
from paged.plugins.suffix import SuffixOptions, SuffixProposer


@hookimpl
def register_speculative_proposers():
    return [
        SpeculativeProposerSpec(
            name="ngram",
            factory=NgramProposer,
            options=NgramOptions,
            description="prompt lookup: the tokens that followed the latest earlier occurrence of the request's "
            "last 2-8 tokens (prompt_lookup_min/max)",
        ),
        SpeculativeProposerSpec(
            name="suffix",
            factory=SuffixProposer,
            options=SuffixOptions,
            description="suffix decoding: what followed the longest earlier match of the request's end, in its own "
            "tokens or recent outputs, up to max_spec_factor x its length",
        ),
        SpeculativeProposerSpec(
            name="draft_model",
            factory=DraftModelProposer,
            options=DraftModelOptions,
            description="a smaller model of the same vocabulary drafts greedily, with its own paged KV cache "
            "(\"model\": its path)",
        ),
    ]
