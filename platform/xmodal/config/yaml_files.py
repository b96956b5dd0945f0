"""The YAML files a user writes (config files, --set values, search spaces and their base files): read
with a strict loader (a key given twice is an error; YAML 1.2's floats such as `1e-3`), each problem one
line naming the file, what is wrong and where."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from xmodal.base.errors import UserError


class ConfigError(UserError):
    """A bad config file, key or value; the message says which and what was expected."""


def read_user_file(p: Path, what: str = "config file", prefix: str = "", error: type[ConfigError] | None = None
                   ) -> str:
    """The text of a file the user names: a missing path, a folder, an unreadable or non-UTF-8 file are
    errors naming it."""
    error = error or ConfigError
    if p.is_dir():
        raise error(f"{prefix}{what} {str(p)!r} is a directory; expected a YAML file")
    if not p.is_file():
        raise error(f"{prefix}{what} {str(p)!r} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{prefix}{p}: not UTF-8 text (byte {e.start}); expected a YAML file") from None
    except OSError as e:
        raise error(f"{prefix}{p}: cannot be read: {e.strerror or e}") from None


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the
    last one silently, so a config with `train:` twice ran with only the second section. Every YAML a
    user writes (config files, --set values, search spaces and their base files) is read with it.
    Keys brought in by a `<<` merge may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # an unhashable key: the base constructor reports it
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given at line {seen.line + 1}, column "
                                    f"{seen.column + 1}); give each key once", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats with an exponent and no point or no exponent sign (`1e-3`, `2.5E4`): YAML 1.1, which
# PyYAML follows, reads them as text, and a strict float field would refuse `lr: 1e-3`.
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(text: str, loader: type[StrictLoader] = StrictLoader) -> Any:
    """YAML a user wrote -> Python data; duplicate keys are errors (`StrictLoader`)."""
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what and where (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what
