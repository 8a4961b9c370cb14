"""Per-request sampling parameters, validated when the request is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from paged.core.errors import InvalidRequestError
from paged.core.structured_output import StructuredOutputParams

# Integers cross the process boundary as msgpack int64; floats become float32 on the device.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
FLOAT32_MAX = 3.4028234663852886e38
# Below this a temperature is greedy (as in vLLM): logits / t would overflow float32 to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def _token_key(key):
    """A logit_bias key: an int, or a JSON object's string key holding one."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    temperature 0 (or below ``GREEDY_TEMPERATURE``, which is then set to 0) means greedy. Every
    integer fits int64 and every float is finite and within float32. ``seed`` (any integer, kept
    modulo 2**64) makes a request's samples reproducible whatever else is in the batch. Stop
    strings are not included in the returned text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    # top-k logprobs per prompt token (plus the prompt's own token) from the model's raw logits; the
    # first prompt token has none. Every prompt position is computed for it (no prefix-cache hit).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema / any JSON object / regex / choice / grammar.
    structured_output: StructuredOutputParams | None = None
    # token id -> added to its logit before anything else (OpenAI's logit_bias: -100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be generated
    # words never generated: the front-end tokenizes each (as written and after a space) into
    # ``bad_words_token_ids``; a word's last token is banned where the output ends with the rest of it
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutputParams.from_dict(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids or []]
        if isinstance(self.logit_bias, dict):  # JSON gives string keys: "123" is token 123
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.seed, int) and not isinstance(self.seed, bool):
            # Any integer is a seed; the sampler's generator reads it modulo 2**64. Kept in int64
            # range (same residue), so it and seed + sample index cross the process boundary.
            self.seed = (self.seed - INT64_MIN) % (1 << 64) + INT64_MIN
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, accepted: str) -> None:
            raise InvalidRequestError(f"{name}: invalid value {getattr(self, name)!r}; {accepted}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or abs(value) > FLOAT32_MAX:
                bad(name, "must be a finite number within float32 range (|x| <= 3.4e38)")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                bad(name, "must be an integer (64-bit)")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20] or None")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be an integer in [0, 20] or None")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.01 <= self.repetition_penalty <= 100.0:  # logits are divided by it in float32
            bad("repetition_penalty", "must be in [0.01, 100] (1 disables it)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a map of token id to bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise InvalidRequestError(f"logit_bias: key {token!r} is not a token id (an integer >= 0)")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    raise InvalidRequestError(f"logit_bias: bias {bias!r} of token {token} must be a number in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids or \
                    any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")
            if self.structured_output is not None:
                bad("allowed_token_ids", "cannot be combined with structured_output (the two masks may leave no token)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-empty strings")
        if any(not isinstance(ids, list) or not ids or any(not is_int(t) or t < 0 for t in ids)
               for ids in self.bad_words_token_ids):
            bad("bad_words_token_ids", "must be a list of non-empty lists of token ids >= 0")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                bad("structured_output", "must be a StructuredOutputParams or a dict of its fields")
            self.structured_output.validate()
            if self.min_tokens:
                # The grammar may allow only EOS while min_tokens forbids it: nothing would be left.
                bad("min_tokens", "must be 0 when structured_output is set")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def copy(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        unknown = set(data) - cls.field_names()
        if unknown:
            raise InvalidRequestError(
                f"sampling parameters: unknown field(s) {sorted(unknown)}; accepted: {sorted(cls.field_names())}"
            )
        return cls(**data)
