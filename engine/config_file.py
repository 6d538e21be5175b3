"""``--config FILE``: flags from a YAML file, as vLLM's ``vllm serve --config config.yaml`` reads them.

The file maps flags' long names (``max-num-seqs`` or ``max_num_seqs``, without the dashes in front)
to values: ``model: /models/gemma-3-1b``, ``enforce-eager: true``, ``api-key: [k1, k2]``,
``hf-overrides: {sliding_window: null}``. A value goes through its flag's own parsing (``512M``,
``32k``, the choices), so a bad one exits 2 as on the command line, naming the file. The command
line wins over the file and the file over the defaults; ``model`` in the file stands for
``serve MODEL``, so a model named on the command line either way wins too.
"""

from __future__ import annotations

import argparse
import json
import sys


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose subcommands read ``--config FILE`` before their command line (its
    values start the namespace the command line then fills: the parser itself is left as it was)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        path = self._config_path(args) if "--config" in self._option_string_actions else None
        if path is None:
            return super().parse_known_args(args, namespace)
        values = _values(self, path, args)
        model = values.pop("model_tag", None)  # (a positional: argparse sets it, given or not)
        namespace = namespace if namespace is not None else argparse.Namespace()
        for dest, value in values.items():
            if not hasattr(namespace, dest):
                setattr(namespace, dest, value)
        given = [a for a in self._actions if a.required and a.dest in values]  # (--prompt: from the file)
        for action in given:
            action.required = False
        try:
            namespace, extras = super().parse_known_args(args, namespace)
        finally:
            for action in given:
                action.required = True
        if model is not None and getattr(namespace, "model_tag", None) is None:
            namespace.model_tag = model
        return namespace, extras

    def _config_path(self, args: list[str]) -> str | None:
        """The last ``--config`` given (argparse's rule), spelled in full, with ``=``, or abbreviated."""
        path = None
        for i, arg in enumerate(args):
            if arg == "--":
                break
            name, eq, value = arg.partition("=")
            if len(name) > 2 and "--config".startswith(name) and \
                    [o for o in self._option_string_actions if o.startswith(name)] == ["--config"]:
                path = value if eq else args[i + 1] if i + 1 < len(args) else None
        return path


def _on_command_line(action: argparse.Action, args: list[str]) -> bool:
    return any(a.partition("=")[0] in action.option_strings for a in args)


JSON_LISTS = ("--allowed-origins",)  # one value on the command line that may be vLLM's JSON list: a list here


def _values(parser: argparse.ArgumentParser, path: str, args: list[str]) -> dict:
    """The file's values, each under its flag's ``dest``, parsed as the command line parses them; not
    those of a repeatable flag the command line gives too (its values replace the file's)."""
    import yaml

    def bad(message: str):
        parser.error(f"--config {path}: {message}")

    class Loader(yaml.SafeLoader):  # (PyYAML keeps the last of a key given twice, silently: a key of two lost)
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=True) for k, _ in node.value]
            twice = [k for i, k in enumerate(keys) if isinstance(k, str) and k in keys[:i]]
            if twice:
                raise yaml.constructor.ConstructorError(None, None, f"{twice[0]!r} is given twice",
                                                        node.start_mark)
            return super().construct_mapping(node, deep)

    try:
        with open(path) as f:
            values = yaml.load(f, Loader)  # noqa: S506 - a SafeLoader
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        bad(str(e))
    if values is None:
        return {}
    if not isinstance(values, dict):
        bad("not a map of flags to values")
    actions = parser._option_string_actions
    out, keys = {}, {}
    for key, value in values.items():
        name = "--" + str(key).replace("_", "-")
        if name == "--config":
            bad("a config file cannot name another")
        action = actions.get(name)
        if action is None:
            bad(f"{key!r} is no flag of this command (see --help)")
        if name in keys:  # (api_key and api-key: the last would win, silently; two flags of one dest are two)
            bad(f"{key} and {keys[name]} are one flag, given twice")
        keys[name] = key
        if value is None:  # (`api-key:` read as the key "null" would open a server to a guess)
            bad(f"{key}: no value (leave the flag out for its default)")
        if name == "--model" and "model_tag" in {a.dest for a in parser._actions} and \
                not _on_command_line(action, args):
            out["model_tag"] = str(value)  # (as `serve MODEL`: one on the command line wins)
            continue
        if isinstance(action, argparse._AppendAction) and _on_command_line(action, args):
            continue
        out[action.dest] = _value(parser, action, name, value, bad)
    return out


def _value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, value, bad):
    if action.nargs == 0:  # a switch: true sets it; false leaves it off (or says --no-, where it has one)
        if not isinstance(value, bool):
            bad(f"{name[2:]}: {value!r} is not true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    if action.nargs == "?" and isinstance(value, bool):  # a flag with an optional value (vLLM's boolean
        # --async-scheduling): true as the bare flag, false as its "off"
        return action.const if value else "off" if "off" in (action.choices or ()) else action.default
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if isinstance(value, list) and not many:
        if name not in JSON_LISTS:
            bad(f"{name[2:]}: one value, not a list")
        value = _text(value)  # (as the command line gives vLLM's JSON list)
    items = value if isinstance(value, list) else [value]
    if None in items:  # (`api-key: [~]` read as the key "null")
        bad(f"{name[2:]}: a list item with no value")
    try:
        parsed = [parser._get_values(action, [_text(v)]) for v in items]
    except argparse.ArgumentError as e:
        bad(str(e))
    if not many:
        return parsed[0]
    if isinstance(action, argparse._AppendAction) and not isinstance(action, argparse._ExtendAction):
        return parsed
    return [p for group in parsed for p in (group if isinstance(group, list) else [group])]


def _text(value) -> str:
    """A YAML value as the command line would have spelled it."""
    if isinstance(value, (dict, list)) or value is None:
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
