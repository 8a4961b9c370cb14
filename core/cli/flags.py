"""The flags of ``paged``: engine settings generated from the typed config, sampling flags, and
an ArgumentParser that answers a misspelled flag with "did you mean".

Flags write into namespaced dests (``cfg:section.field``, ``sp:field``) so that only the flags a
user gave reach the config / SamplingParams (``default=SUPPRESS``); the metavars shown in
``--help`` are the value's type, never those dests.
"""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from paged.core.config import EngineConfig, config_flags, load_config, parse_key_values
from paged.core.errors import ConfigError, PagedError

CFG = "cfg:"
SP = "sp:"


class Parser(argparse.ArgumentParser):
    """An unknown option is reported by the (sub)command that got it, with the closest known
    flag: ``paged run --polcy fcfs`` -> "unrecognized argument --polcy (did you mean --policy?)".

    Abbreviations are off (``--max-token`` is not ``--max-tokens``): with them a typo, or a flag
    added later, silently picks another flag. Subparsers are made with this class, so they
    inherit it."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._deepest_subparser(namespace)
            parser.error(unknown_args_message(parser, extras))
        return namespace

    def _deepest_subparser(self, namespace) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self
        while True:
            actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = getattr(namespace, actions[0].dest, None) if actions else None
            if chosen is None or chosen not in actions[0].choices:
                return parser
            parser = actions[0].choices[chosen]


def unknown_args_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    parts = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("-") else []
        parts.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    return "unrecognized arguments: " + " ".join(parts)


def _metavar(annotation: Any) -> str:
    """The value's type for --help: INT, FLOAT, TEXT, or {a,b,c} for a Literal."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    return {int: "INT", float: "FLOAT"}.get(annotation, "TEXT")


def _help(section: str | None, field: str, description: str) -> str:
    model = EngineConfig.model_fields[field] if section is None else getattr(
        EngineConfig.model_fields[section].annotation, "model_fields")[field]
    default = model.get_default(call_default_factory=True)
    key = field if section is None else f"{section}.{field}"
    if default is not None and "default" not in description:
        key += f", default {str(default).lower() if isinstance(default, bool) else default}"
    return f"{description} [{key}]".strip().replace("%", "%%")


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("server",)) -> None:
    """One flag per config field; ``skip``: sections (``server``) or ``section.field`` names left
    out because the command has no use for them or sets them its own way."""
    group = parser.add_argument_group("engine settings (also settable by --config FILE or PAGED_* env)")
    group.add_argument("--config", dest="config_file", metavar="FILE", help="TOML or YAML config file")
    for flag in config_flags():
        if flag.section in skip or f"{flag.section}.{flag.field}" in skip:
            continue
        dest = f"{CFG}{flag.section or ''}.{flag.field}"
        help_text = _help(flag.section, flag.field, flag.help)
        if flag.annotation is bool:
            group.add_argument(f"--{flag.name}", dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        elif flag.annotation == list[str]:  # vLLM's form: --lora-modules a=PATH b=PATH
            group.add_argument(f"--{flag.name}", dest=dest, nargs="+", default=argparse.SUPPRESS, help=help_text,
                               metavar="TEXT")
        else:
            group.add_argument(f"--{flag.name}", dest=dest, default=argparse.SUPPRESS, help=help_text,
                               metavar=_metavar(flag.annotation))
    if "scheduler.policy" not in skip:
        group.add_argument("--policy-option", action="append", metavar="KEY=VALUE",
                           help="an option of the selected policy, e.g. aging_s=5 (repeatable)")
    group.add_argument("--attention-option", action="append", metavar="KEY=VALUE",
                       help="an option of the selected attention backend (repeatable)")
    group.add_argument("--structured-output-option", action="append", metavar="KEY=VALUE",
                       help="an option of the selected structured-output backend (repeatable)")
    group.add_argument("--quantization-option", action="append", metavar="KEY=VALUE",
                       help="an option of the selected quantization method, e.g. dense_copy=false (repeatable)")
    group.add_argument("--speculative-config", metavar="JSON",
                       help="the speculative section as JSON (vLLM's flag), e.g. '{\"method\": \"ngram\", "
                       "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith(CFG):
            continue
        section, _, field = key[len(CFG):].partition(".")
        if section:
            overrides.setdefault(section, {})[field] = value
        else:
            overrides[field] = value
    policy_options = parse_key_values(getattr(args, "policy_option", None), "policy-option")
    if policy_options:
        overrides.setdefault("scheduler", {})["policy_options"] = policy_options
    attention_options = parse_key_values(args.attention_option, "attention-option")
    if attention_options:
        overrides.setdefault("attention", {})["options"] = attention_options
    structured_options = parse_key_values(getattr(args, "structured_output_option", None), "structured-output-option")
    if structured_options:
        overrides.setdefault("structured_output", {})["options"] = structured_options
    quantization_options = parse_key_values(getattr(args, "quantization_option", None), "quantization-option")
    if quantization_options:
        overrides.setdefault("model", {})["quantization_options"] = quantization_options
    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:
        try:
            section = json.loads(speculative)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config: not JSON ({e}): {speculative!r}") from None
        if not isinstance(section, dict):
            raise ConfigError(f"--speculative-config: expected a JSON object, got {speculative!r}")
        overrides["speculative"] = {**overrides.get("speculative", {}), **section}
    return load_config(args.config_file, overrides)


# --- sampling flags of `paged run` ----------------------------------------------------------------
SAMPLING_FLAGS = {
    # flag: (SamplingParams field, type, metavar, help)
    "temperature": ("temperature", float, "FLOAT", "0 = greedy (the default of paged run); higher = more random"),
    "top-p": ("top_p", float, "FLOAT", "nucleus sampling: keep the smallest set of tokens with this much probability, (0, 1]"),
    "top-k": ("top_k", int, "INT", "keep only the k most likely tokens (0 = off)"),
    "min-p": ("min_p", float, "FLOAT", "drop tokens below min_p x the top token's probability, [0, 1]"),
    "max-tokens": ("max_tokens", int, "INT", "most new tokens per completion (default 128)"),
    "min-tokens": ("min_tokens", int, "INT", "no EOS or stop before this many new tokens"),
    "seed": ("seed", int, "INT", "make each request's sampling reproducible"),
    "n": ("n", int, "INT", "completions per prompt"),
    "logprobs": ("logprobs", int, "INT", "also return the top-k log-probabilities of each token, [0, 20]"),
    "presence-penalty": ("presence_penalty", float, "FLOAT", "penalize tokens already generated, [-2, 2]"),
    "frequency-penalty": ("frequency_penalty", float, "FLOAT", "penalize tokens by how often they were generated, [-2, 2]"),
    "repetition-penalty": ("repetition_penalty", float, "FLOAT", "divide the logits of seen tokens (> 1 discourages repeats; 1 = off)"),
}


def add_sampling_flags(parser: argparse.ArgumentParser, title: str) -> None:
    sampling = parser.add_argument_group(title)
    for flag, (field, typ, metavar, help_text) in SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{flag}", dest=f"{SP}{field}", type=typ, metavar=metavar,
                              default=argparse.SUPPRESS, help=help_text)
    sampling.add_argument("--stop", dest=f"{SP}stop", action="append", default=argparse.SUPPRESS, metavar="TEXT",
                          help="stop string, not included in the output (repeatable)")
    sampling.add_argument("--stop-token-ids", dest=f"{SP}stop_token_ids", metavar="ID,ID,...",
                          type=lambda s: [int(x) for x in s.split(",")], default=argparse.SUPPRESS,
                          help="comma-separated token ids that end a completion")
    sampling.add_argument("--ignore-eos", dest=f"{SP}ignore_eos", action="store_true", default=argparse.SUPPRESS,
                          help="keep generating past the end-of-sequence token (benchmarks)")


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len(SP):]: v for k, v in vars(args).items() if k.startswith(SP)}


# --- structured-output flags of `paged run` --------------------------------------------------------
def add_structured_output_flags(parser: argparse.ArgumentParser) -> None:
    structured = parser.add_argument_group("structured output (at most one; see --structured-output-backend)")
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", metavar="TEXT", help="the output matches this regular expression")
    structured.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is one of these strings (repeatable)")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (the backend's syntax)")


def structured_output_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --json-schema / --json-object / --regex / --choice / --grammar flags as the
    ``structured_output`` sampling field (None when none is given)."""
    out: dict[str, Any] = {}
    for flag, field in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, flag, None)
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as e:
                raise PagedError(f"--{flag.replace('_', '-')}: cannot read {path!r}: {e}") from None
            out[field] = text
    if getattr(args, "json_object", False):
        out["json_object"] = True
    if getattr(args, "regex", None) is not None:
        out["regex"] = args.regex
    if getattr(args, "choice", None):
        out["choice"] = list(args.choice)
    if len(out) > 1:
        raise PagedError(f"structured output: give at most one of --json-schema, --json-object, --regex, --choice, "
                         f"--grammar (got {', '.join('--' + k.replace('_', '-') for k in out)})")
    return out or None
