"""Incremental detokenization with stop strings.

Two offsets into the output token ids (the prefix-offset / read-offset technique):

* ``ids[prefix_offset:read_offset]`` is a small window of tokens whose text has already been
  decoded; it is decoded again only as left context, so that tokenizers whose decoding of a
  token depends on its neighbours (a SentencePiece leading space, for instance) still give the
  right text;
* ``ids[read_offset:]`` are the tokens whose text is not decoded yet.

Each update decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the
difference is the new text. When the new text ends with U+FFFD, the last token(s) stopped in the
middle of a multi-byte UTF-8 character: nothing is decoded and the offsets stay put until a later
token completes the character. So each step decodes a window of a few tokens whatever the length
of the output, and the decoded texts concatenate to ``tokenizer.decode(output_ids,
skip_special_tokens=...)``.

The prompt is not used as context: the text is that of the output alone, exactly
``decode(output_ids)`` (for SentencePiece-style tokenizers this means the first output token's
leading space is dropped, as ``decode`` does; vLLM instead decodes with the prompt's last tokens
as context and keeps it). Pass ``prompt_context=True`` to get vLLM's behaviour.

Stop strings: the decoded text is searched from ``len(stop) - 1`` characters before the new
text, so a stop string spread over several tokens is found. The emitted text lags the decoded
text by the longest suffix that is a proper prefix of some stop string (at most the longest stop
string's length - 1 characters), since those characters may have to be cut. With
``include_stop_str_in_output`` nothing needs holding back. ``finalize()`` returns what is still
held back (and the text of any token left incomplete) when the request ends for another reason.
"""

from __future__ import annotations

from paged.core.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# A trailing U+FFFD normally means an incomplete character that the next tokens complete (a
# UTF-8 character is at most 4 bytes). After this many undecoded tokens it is taken as a real
# (invalid-bytes) replacement character and emitted, so a model emitting garbage bytes cannot
# make the window, and the cost per step, grow without bound.
_MAX_PENDING_TOKENS = 16
# Drop the token ids before the decode window once there are this many.
_TRIM_AT = 1024
# Prompt tokens used as left context when prompt_context=True (as vLLM does).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, applying stop strings."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt_context: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self._decode_fn = self._make_decode(tokenizer, self.skip_special_tokens)

        # Token ids being decoded: optionally a few prompt tokens of context, then the output.
        if prompt_context and prompt_token_ids:
            self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        else:
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

        self._held = ""  # decoded text not emitted yet (it may start a stop string)
        # All text emitted so far, as the pieces emitted (``text`` joins them when asked): a
        # string grown at every step would be copied whole at every step.
        self._pieces: list[str] = []
        self._tail = ""  # the last (longest stop - 1) characters emitted: a stop string's left context
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False  # finalize() was called

        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

    @property
    def text(self) -> str:
        """All text emitted so far (joined now; the pieces become one, so asking again is cheap)."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    # ---------------------------------------------------------------- decode

    @staticmethod
    def _make_decode(tokenizer, skip: bool):
        """A function ids -> text equal to ``tokenizer.decode(ids, skip_special_tokens=skip)``.

        A transformers fast tokenizer without clean-up is decoded through its ``tokenizers``
        backend directly (the same call ``decode`` ends in, minus its per-call overhead).
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return lambda ids: backend.decode(ids, skip_special_tokens=skip)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)

    def _decode_new(self, force: bool) -> str:
        """Decode the pending tokens; '' while they end inside an incomplete character."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._decode_fn(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode_fn(ids[self._prefix_offset :])
        pending = len(ids) - self._read_offset
        if not force and pending < _MAX_PENDING_TOKENS:
            if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
                # Incomplete character, or nothing new yet (e.g. only skipped special tokens).
                return ""
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text) :]
        else:  # a decoder whose text over the window does not extend the context's: decode alone
            delta = self._decode_fn(ids[self._read_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > _TRIM_AT:  # ids before the window are never looked at again
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    # ------------------------------------------------------------------ API

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    def update(self, new_token_ids: list[int]) -> str:
        """Add generated token ids; return the text to emit now ('' once stopped)."""
        if self.stopped or self.finished:
            return ""
        self._ids.extend(new_token_ids)
        delta = self._decode_new(force=False)
        return self._advance(delta, final=False)

    def finalize(self) -> str:
        """The request ended for another reason (EOS, length, abort): return held-back text."""
        if self.stopped or self.finished:
            return ""
        delta = self._decode_new(force=True)
        out = self._advance(delta, final=True)
        self.finished = True
        return out

    flush = finalize

    # ----------------------------------------------------------- stop strings

    def _advance(self, delta: str, final: bool) -> str:
        """Add newly decoded text, look for stop strings, return what can be emitted now.

        Works on the held-back text, the new text and at most ``longest stop - 1`` characters
        before them, so the cost does not grow with the length of the output.
        """
        pending = self._held + delta  # decoded, not emitted
        if self._stops and delta:
            # Context: the last (longest stop - 1) characters decoded before the new text.
            ctx_len = self._max_stop_len - 1
            if len(self._held) >= ctx_len:
                ctx = self._held[len(self._held) - ctx_len :]
            else:
                tail = self._tail
                ctx = tail[max(0, len(tail) - (ctx_len - len(self._held))) :] + self._held
            found = self._find_stop(ctx + delta, len(ctx))
            if found is not None:
                start, stop = found  # in ctx + delta
                end = start + len(stop) if self.params.include_stop_str_in_output else start
                # Position in `pending` (ctx + delta ends where pending ends); never < 0, as
                # whatever may start a stop string was held back.
                cut = max(0, end - (len(ctx) + len(delta) - len(pending)))
                self.stopped = True
                self.stop_reason = stop
                self._held = ""
                return self._emit(pending[:cut])
        if final or not self._stops or self.params.include_stop_str_in_output:
            self._held = ""
            return self._emit(pending)
        keep = self._held_back(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def _emit(self, out: str) -> str:
        if out:
            self._pieces.append(out)
            if self._max_stop_len > 1:  # keep what a later stop string may start in
                keep = self._max_stop_len - 1
                tail = self._tail + out
                self._tail = tail[len(tail) - keep :] if len(tail) > keep else tail
        return out

    def _find_stop(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The stop string that completes first in ``text[new_from:]``: (start index, stop string)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_back(self, pending: str) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop string.

        (Text emitted earlier could not start a stop string then, so it cannot now either.)
        """
        longest = 0
        n = len(pending)
        for stop in self._stops:
            for k in range(min(len(stop) - 1, n), longest, -1):
                if pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
