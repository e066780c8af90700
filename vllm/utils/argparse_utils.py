"""`FlexibleArgumentParser`: argparse with vLLM's command-line spellings.

`FlexibleArgumentParser.parse_args` rewrites argv before argparse sees it:

* `--long_option` -> `--long-option`: underscores between `--` and the first `.` or `=`
  become dashes (`--optimization_level=1` works).
* `-O<x>` / `-O=<x>` -> `--optimization-level <x>` (any suffix; the option's type validates
  it), `-O <x>` -> `--optimization-level <x>` unless `<x>` is another flag; a bare `-O`
  (last, or before another flag) is an error naming the levels.
* Dotted keys of any option that takes a value (meant for the JSON-valued ones):
  `-cc.pass_config.fuse_norm_quant=false`, `-cc.mode 3`, `--compilation-config.backend=eager`,
  `--hf-overrides.rope_scaling.factor 2`.
  The value is JSON-decoded when possible, else kept as a string. A key ending in `+`
  (`-cc.custom_ops+=+rms_norm,-quant_fp8`) splits the value on commas into a list, and
  repeated `+` keys concatenate. All dotted tokens of one option merge into one nested dict,
  appended at the END of argv as `--option <json>`, so it replaces an earlier full JSON value.
* Repeated options (and repeated dotted scalar keys): the last one wins, and one warning
  "Found duplicate keys ..." names them.
* `--config FILE.yaml` (upstream's): the file's keys are options (`port: 8000`,
  `tensor-parallel-size: 2` or `tensor_parallel_size: 2`; `true` = a switch given, `false` =
  the switch's inverse where the parser has one (`--no-x`, or `--disable-x` for `enable-x`),
  else not given; lists = several values, mappings = JSON), spliced in where `--config`
  stands (`load_config_file` returns them); an option also given on the command line keeps the
  command line's value. `--config` is listed in the `--help` of every parser without
  subcommands (`vllm serve --help`), as upstream's. A file that is missing raises
  FileNotFoundError; a file that is no .yaml/.yml, no YAML mapping, or a `--config` without a
  file raises ValueError. `vllm serve --config FILE` with no model, neither as MODEL nor in
  the file, raises ValueError "No model specified!".
* `vllm serve --model M ...` (no MODEL given) -> `vllm serve M ...`, as upstream.

Errors of argparse itself are one line, `<prog>: error: <message>`, exit code 2, without the
usage block; `vllm`'s main turns the ValueError / FileNotFoundError above into the same line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vllm.config.utils import parse_human_size
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["FlexibleArgumentParser", "human_int", "json_dict_type", "non_negative_int",
           "positive_int"]

_LEVEL_OPTION = "--optimization-level"


# ---- argparse `type=` helpers (their errors name the bad value and what is allowed) -------
def _to_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        pass
    try:
        return parse_human_size(text, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid integer {text!r}: use a whole number such as 16 (k/M/G suffixes allowed)"
        ) from None


def human_int(text: str) -> int:
    """An integer, also written human-readable (`2k`, `1M`, `4GiB`)."""
    return _to_int(text)


def positive_int(text: str) -> int:
    """An integer > 0 (human-readable suffixes allowed)."""
    value = _to_int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (human-readable suffixes allowed)."""
    value = _to_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def parse_json_object(text: str, what: str) -> dict:
    """Decode `text` as a JSON object; errors give the JSON error position (line/column/char)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON for {what}: {exc.msg} at line {exc.lineno} column "
                         f"{exc.colno} (char {exc.pos}) in {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object like '{{\"mode\": 3}}', got {text!r}")
    return value


def json_dict_type(what: str, validate: Callable[[dict], Any] | None = None
                   ) -> Callable[[str], dict]:
    """An argparse `type` for a JSON-object option that also accepts dotted keys.

    The returned callable decodes the JSON, runs `validate(dict)` (a ValueError there, such as
    an unknown key, becomes the argparse error) and returns the plain dict: only the keys the
    user gave, so later resolution can tell user values from defaults."""

    def convert(text: str) -> dict:
        try:
            data = parse_json_object(text, what)
            if validate is not None:
                validate(data)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return data

    convert.__name__ = f"{what} JSON"
    convert.accepts_dotted_keys = True  # type: ignore[attr-defined]
    return convert


# ---- the parser ----------------------------------------------------------------------------
_CONFIG_HELP = ("Read options from a YAML file of option: value lines (e.g. `port: 8000`, "
                "`tensor-parallel-size: 2`); options also given on the command line keep the "
                "command line's values.")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that accepts vLLM's spellings (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # For --help only: parse_args splices the file's options in before argparse runs,
        # so this action never receives a value (args.config stays None).
        self._config_action: argparse.Action | None = super().add_argument(
            "--config", metavar="FILE.yaml", default=None, help=_CONFIG_HELP)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's; a `--config` of the caller's replaces the built-in one (the file is
        still read by `parse_args`)."""
        if "--config" in args:
            self._drop_config_action()
        return super().add_argument(*args, **kwargs)

    def _drop_config_action(self) -> None:
        action = getattr(self, "_config_action", None)
        if action is None:
            return
        self._config_action = None
        self._remove_action(action)
        for group in self._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        for option in action.option_strings:
            self._option_string_actions.pop(option, None)

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        """As argparse's; a parser with subcommands leaves `--config` to them (the file holds
        a subcommand's options)."""
        self._drop_config_action()
        return super().add_subparsers(**kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(self.preprocess_argv(argv), namespace)

    def error(self, message: str) -> NoReturn:
        """Print one line `<prog>: error: <message>` on stderr and exit with code 2."""
        line = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {line}\n")

    # ---- argv rewriting ------------------------------------------------------------------
    def load_config_file(self, file_path: str, argv: Sequence[str] = ()) -> list[str]:
        """The options a YAML config file holds, as command-line tokens (see the module
        docstring); `argv` names the subcommand whose options a `false` may invert."""
        extension = os.path.splitext(file_path)[1].lower()
        if extension not in (".yaml", ".yml"):
            raise ValueError(f"--config {file_path!r}: the config file must be a .yaml or .yml "
                             f"file, got {extension or 'no extension'}")
        if not os.path.exists(file_path):
            raise FileNotFoundError(f"--config {file_path!r}: no such file")
        import yaml

        try:
            with open(file_path) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--config {file_path!r}: cannot read it as YAML ({exc})") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"--config {file_path!r} must hold a YAML mapping of option: value, "
                             f"got a {type(data).__name__}")
        options = self._option_actions(argv)
        tokens: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            if value is None:
                continue
            if value is False:
                tokens += [inverse] if (inverse := _inverse_flag(flag, options)) else []
            elif value is True:
                tokens.append(flag)
            elif isinstance(value, list):
                tokens += [flag, *map(str, value)] if value else []
            elif isinstance(value, dict):
                tokens += [flag, json.dumps(value)]
            else:
                tokens += [flag, str(value)]
        return tokens

    def _expand_config_file(self, argv: list[str]) -> list[str]:
        """`--config FILE` -> the file's options in its place; the command line's own options
        win over the file's."""
        i = next((i for i, t in enumerate(argv) if t == "--config" or t.startswith("--config=")),
                 None)
        if i is None:
            return argv
        token = argv[i]
        if token == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError("No config file specified! --config needs a YAML file, e.g. "
                                 "--config serve.yaml")
            path, rest = argv[i + 1], argv[i + 2:]
        else:
            path, rest = token.split("=", 1)[1], argv[i + 1:]
        file_tokens = self.load_config_file(path, argv)
        if argv[:1] == ["serve"]:
            model_given = (len(argv) > 1 and not argv[1].startswith("-")) or any(
                t == "--model" or t.startswith("--model=") for t in [*argv, *file_tokens])
            if not model_given:
                raise ValueError("No model specified! Give the model as `vllm serve MODEL` or "
                                 "as `model: ...` in the config file.")
        given = {_normalize_long_option(t).split("=", 1)[0] for t in argv if t.startswith("--")}
        kept: list[str] = []
        skipping = False
        for t in file_tokens:
            if t.startswith("--"):
                skipping = t in given or _inverse_of(t) in given
                if skipping:
                    continue
            elif skipping:
                continue
            kept.append(t)
        return argv[:i] + kept + rest

    def preprocess_argv(self, argv: list[str]) -> list[str]:
        """Rewrite vLLM spellings into plain argparse tokens (the contract is the module
        docstring). Exits through `error()` on a malformed dotted key."""
        argv = self._expand_config_file(_model_option_to_positional(argv))
        if "--" in argv:
            cut = argv.index("--")
            argv, tail = argv[:cut], argv[cut:]
        else:
            tail = []
        options = self._option_actions(argv)
        out: list[str] = []
        dotted: dict[str, dict] = {}
        duplicates: list[str] = []
        i = 0
        while i < len(argv):
            token = _normalize_long_option(argv[i])
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            i += 1
            if token == "-O":
                # "-O 2"; "-O banana" / "-O -1" reach the level's own check (a clear error).
                if nxt is None or (nxt.startswith("-") and not nxt[1:].isdigit()):
                    self.error("-O needs a level: 0, 1, 2 or 3 (e.g. -O2, -O 2, -O=2)")
                out += [_LEVEL_OPTION, nxt]
                i += 1
                continue
            if token.startswith("-O=") or (token.startswith("-O") and len(token) > 2
                                            and not token.startswith("--")):
                out += [_LEVEL_OPTION, token[3:] if token.startswith("-O=") else token[2:]]
                continue
            key, has_value, value = token.partition("=")
            head = key.split(".", 1)[0]
            if not (token.startswith("-") and "." in key and head in options):
                out.append(token)
                continue
            action = options[head]
            canonical = _canonical(action)
            if action.nargs == 0:
                self.error(f"{token!r}: {canonical} is a switch and takes no dotted keys; "
                           "they are for options that take JSON, such as "
                           "--compilation-config (-cc)")
            if not has_value:
                if nxt is None:
                    self.error(f"{token!r} needs a value: write {key}=VALUE or {key} VALUE")
                value = nxt
                i += 1
            path = key.split(".")[1:]
            append = path[-1].endswith("+")
            if append:
                path[-1] = path[-1][:-1]
            if any(not part for part in path):
                self.error(f"{token!r}: empty key in the dotted path {key!r}; write e.g. "
                           f"{head}.pass_config.fuse_norm_quant=false")
            decoded = _decode_list(value) if append else _decode(value)
            _merge_path(dotted.setdefault(canonical, {}), path, decoded, append,
                        canonical, duplicates)
        for canonical, data in dotted.items():
            out += [canonical, json.dumps(data)]
        duplicates = _duplicate_options(out, options) + duplicates
        if duplicates:
            logger.warning("Found duplicate keys %s (the last value given wins)",
                           ", ".join(dict.fromkeys(duplicates)))
        return out + tail

    def _option_actions(self, argv: Sequence[str] = ()) -> dict[str, argparse.Action]:
        """Option string -> its action, for the subcommand `argv` names (this parser and the
        subcommand parsers on the way, e.g. `bench startup`); without one, every option of
        this parser and of all its subcommands' parsers (a dict-valued action wins when two
        subcommands spell an option differently)."""
        chain = _subcommand_chain(self, argv)
        if len(chain) > 1:
            return {option: action for parser in chain for action in parser._actions
                    for option in action.option_strings}
        found: dict[str, argparse.Action] = {}
        stack: list[argparse.ArgumentParser] = [self]
        seen: set[int] = set()
        while stack:
            parser = stack.pop()
            if id(parser) in seen:
                continue
            seen.add(id(parser))
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack.extend(action.choices.values())
                for option in action.option_strings:
                    if option not in found or getattr(action.type, "accepts_dotted_keys", False):
                        found[option] = action
        return found


def _inverse_flag(flag: str, options: dict[str, argparse.Action]) -> str | None:
    """The option that turns switch `flag` off, where the parser has one: `--no-x`
    (BooleanOptionalAction), or `--disable-x` for `--enable-x`."""
    for candidate in ("--no-" + flag[2:], _inverse_of(flag)):
        if candidate and candidate in options:
            return candidate
    return None


def _inverse_of(flag: str) -> str | None:
    """`--enable-x` <-> `--disable-x` (None for other names)."""
    if flag.startswith("--enable-"):
        return "--disable-" + flag[len("--enable-"):]
    if flag.startswith("--disable-"):
        return "--enable-" + flag[len("--disable-"):]
    return None


def _model_option_to_positional(argv: list[str]) -> list[str]:
    """`serve ... --model M ...` without a positional MODEL -> `serve M ...` (upstream's
    spelling for `vllm serve`; the positional MODEL is its own)."""
    if argv[:1] != ["serve"] or (len(argv) > 1 and not argv[1].startswith("-")):
        return argv
    for i, token in enumerate(argv):
        if token == "--model" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return ["serve", argv[i + 1], *argv[1:i], *argv[i + 2:]]
        if token.startswith("--model="):
            return ["serve", token.split("=", 1)[1], *argv[1:i], *argv[i + 1:]]
    return argv


def _subcommand_chain(parser: argparse.ArgumentParser, argv: Sequence[str]
                      ) -> list[argparse.ArgumentParser]:
    """`parser`, then the parser of each subcommand `argv` selects, in order."""
    chain = [parser]
    rest = list(argv)
    while True:
        subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return chain
        index = next((i for i, t in enumerate(rest) if t in subs[0].choices), None)
        if index is None:
            return chain
        chain.append(subs[0].choices[rest[index]])
        rest = rest[index + 1:]


def _normalize_long_option(token: str) -> str:
    """`--a_b.c_d=e_f` -> `--a-b.c_d=e_f`: only the option name before `.` or `=` changes."""
    if not token.startswith("--") or token == "--":
        return token
    end = len(token)
    for sep in (".", "="):
        pos = token.find(sep)
        if pos != -1:
            end = min(end, pos)
    return token[:end].replace("_", "-") + token[end:]


def _canonical(action: argparse.Action) -> str:
    long_options = [o for o in action.option_strings if o.startswith("--")]
    return (long_options or action.option_strings)[0]


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _decode_list(text: str) -> list:
    value = _decode(text)
    if isinstance(value, list):
        return value
    return [_decode(item.strip()) for item in text.split(",") if item.strip()]


def _merge_path(root: dict, path: list[str], value: Any, append: bool, prefix: str,
                duplicates: list[str]) -> None:
    """Set `root[path...] = value`; `append` concatenates lists; overwrites are reported."""
    node = root
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            if child is not None:
                duplicates.append(".".join([prefix, *path[:depth + 1]]))
            child = node[part] = {}
        node = child
    leaf, name = path[-1], ".".join([prefix, *path])
    existing = node.get(leaf)
    if append:
        if isinstance(existing, list):
            existing.extend(value)
            return
        if existing is not None:
            duplicates.append(name)
        node[leaf] = list(value)
    elif isinstance(existing, dict) and isinstance(value, dict):
        for key, sub in value.items():
            _merge_path(existing, [key], sub, False, name, duplicates)
    else:
        if leaf in node:
            duplicates.append(name)
        node[leaf] = value


def _duplicate_options(argv: list[str], options: dict[str, argparse.Action]) -> list[str]:
    """Canonical names of the options that appear more than once in `argv`."""
    counts: dict[str, int] = {}
    for token in argv:
        if not token.startswith("-"):
            continue
        action = options.get(token.split("=", 1)[0])
        if action is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                                 argparse._AppendAction)):
            continue  # (an append option is meant to be repeated)
        name = _canonical(action)
        counts[name] = counts.get(name, 0) + 1
    return [name for name, count in counts.items() if count > 1]
