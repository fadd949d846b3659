"""deploytool's one YAML reader: a YAML document as plain dicts, lists and scalars, bounded and strict.

    read(text, source=NAME, places={})   the document; `places` (when given) filled with key path -> (line, column)
                                         as far as the read got, also when it refuses
    place(exc, NAME, places, text)       a ConfigError as `NAME:LINE:COLUMN: key: message`, placed by those places
    shown(value)                         a value as an error message shows it

Only PyYAML's event parser is used (libyaml's when PyYAML has it); the document is built here, refusing, with the
key path and line, what a deploytool document never needs and an attacker would use: aliases and anchors (an alias
bomb expands exponentially), merge keys, tags (!!python/..., !!binary, !!set), nesting deeper than MAX_DEPTH, more
than MAX_NODES keys and values, keys that are not strings, duplicate keys (both lines named), more than one
document, integers longer than MAX_INT_DIGITS. Every refusal is a ConfigError. Scalars resolve by strict rules
(_INT_RE, _FLOAT_RE below): anything YAML 1.1 would read as a number or a bool but 1.2 would not stays a string.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from deploy_tool.errors import ConfigError


def shown(v: Any) -> str:
    """A value as an error message shows it: short, and true/false/null as YAML spells them."""
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return ".nan" if v != v else ".inf" if v > 0 else "-.inf"
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:  # repr of a huge int is slow or refused
        return f"{'-' if v < 0 else ''}an integer of {int(v.bit_length() * 0.30103) + 1} digits"
    try:
        s = repr(v)
    except (RecursionError, ValueError):
        return f"a deeply nested {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


MAX_DEPTH = 16  # the schema nests 5 deep (backends.NAME.speculative.KEY, lists of strings)
MAX_NODES = 10_000  # keys and values; the two-2080ti example has about 200, and every value costs checks later
MAX_INT_DIGITS = 100  # far beyond any setting's range, far below Python's int/str conversion limit

_STR_TAG = "tag:yaml.org,2002:str"
_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
# Numbers as YAML 1.2 writes them, kept within what PyYAML's (1.1) resolver reads the same way, so a document
# written by yaml.safe_dump reads back unchanged. Everything else plain (yes/no/on/off, 0x1F, 0o17, 1_000, 1e3,
# 12:30, 2026-12-01, +5, 007) is a string, which a number or true/false setting then refuses by its key path.
_INT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)")
_FLOAT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)\.[0-9]*(?:[eE][-+][0-9]+)?|\.[0-9]+(?:[eE][-+][0-9]+)?")
_FLOAT_WORDS = {".inf": float("inf"), ".Inf": float("inf"), ".INF": float("inf"), "-.inf": float("-inf"),
                "-.Inf": float("-inf"), "-.INF": float("-inf"), ".nan": float("nan"), ".NaN": float("nan"),
                ".NAN": float("nan")}
_SIMPLE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")
_NO_ALIAS_HINT = "write the value out in full: a deploytool config takes no anchors (&) or aliases (*)"


def _key_path(path: str, key: str) -> str:
    """The key path of `key` under `path`; an odd key (dots, spaces, control characters) shown quoted."""
    k = key if _SIMPLE_KEY_RE.fullmatch(key) else f"[{key!r}]"
    return k if not path else f"{path}{k}" if k.startswith("[") else f"{path}.{k}"


def _where(path: str, line: int) -> str:
    return f"{path} (line {line})" if path else f"line {line}"


class _Reader:
    """Builds the document straight from the parser's events, refusing on the way what the module's doc names."""

    def __init__(self, text: str, name: str) -> None:
        self.yaml = yaml
        self.E = yaml.events
        # Only the event parser is used (the C one is ~10x faster); construction is ours.
        self.loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
        self.text = text
        self.name = name
        self.nodes = 0
        self.pos: dict[str, tuple[int, int]] = {}  # key path -> (line, column) of its key, or its value in a list

    def compose(self) -> Any:
        try:
            return self._stream()
        except self.yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{self.name}{where}: malformed YAML: {exc.problem or exc.context or exc}",
                              hint="fix the YAML syntax (indentation, quotes, colons)") from None
        except self.yaml.reader.ReaderError as exc:
            ch = chr(exc.character) if isinstance(exc.character, int) else str(exc.character)
            pos = self.text.find(ch)
            line = self.text.count("\n", 0, pos) + 1 if pos >= 0 else None
            col = pos - self.text.rfind("\n", 0, pos) if pos >= 0 else None
            raise ConfigError(f"{self.name}{f':{line}:{col}' if line else ''}: the character "
                              f"{ch!r} is not allowed in YAML ({exc.reason})",
                              hint="remove it, or write it as an escape inside double quotes") from None
        except self.yaml.YAMLError as exc:
            raise ConfigError(f"{self.name}: malformed YAML: {str(exc).splitlines()[0] if str(exc) else exc}",
                              hint="fix the YAML syntax") from None
        finally:
            self.loader.dispose()

    def _stream(self) -> Any:
        E, get = self.E, self.loader.get_event
        get()  # StreamStartEvent
        if self.loader.check_event(E.StreamEndEvent):
            return None
        get()  # DocumentStartEvent
        value = self._node("", 0)
        get()  # DocumentEndEvent
        ev = get()
        if not isinstance(ev, E.StreamEndEvent):
            raise ConfigError(f"{self.name}:{ev.start_mark.line + 1}:{ev.start_mark.column + 1}: a second YAML "
                              f"document; a config is one "
                              f"document", hint="remove the '---' line and what follows it, or merge the two")
        return value

    def _refuse_shared(self, ev: Any, path: str, line: int) -> None:
        if isinstance(ev, self.E.AliasEvent):
            raise ConfigError(f"{_where(path, line)}: the YAML alias *{ev.anchor} is not accepted", hint=_NO_ALIAS_HINT)
        if getattr(ev, "anchor", None) is not None:
            raise ConfigError(f"{_where(path, line)}: the YAML anchor &{ev.anchor} is not accepted",
                              hint=_NO_ALIAS_HINT)

    def _tag(self, ev: Any, path: str, line: int, plain: str) -> None:
        if ev.tag not in (None, "!", plain):
            tag = ev.tag.replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(f"{_where(path, line)}: the YAML tag {tag} is not accepted",
                              hint="remove the tag: a config holds plain strings, numbers, true/false, null, lists "
                                   "and mappings")

    def _node(self, path: str, depth: int) -> Any:
        E = self.E
        ev = self.loader.get_event()
        line = ev.start_mark.line + 1
        self.pos.setdefault(path, (line, ev.start_mark.column + 1))
        self._refuse_shared(ev, path, line)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ConfigError(f"{_where(path, line)}: the config holds more than {MAX_NODES} keys and values",
                              hint="a deploytool config holds a few hundred; check that --config names the config")
        if isinstance(ev, E.ScalarEvent):
            return self._scalar(ev, path, line)
        if depth >= MAX_DEPTH:
            raise ConfigError(f"{_where(path, line)}: nested deeper than {MAX_DEPTH} levels",
                              hint="a deploytool config nests at most 5 levels; check the indentation")
        if isinstance(ev, E.SequenceStartEvent):
            self._tag(ev, path, line, "tag:yaml.org,2002:seq")
            items: list[Any] = []
            while not self.loader.check_event(E.SequenceEndEvent):
                items.append(self._node(f"{path}[{len(items)}]", depth + 1))
            self.loader.get_event()
            return items
        self._tag(ev, path, line, "tag:yaml.org,2002:map")  # a MappingStartEvent: nothing else starts a node
        out: dict[str, Any] = {}
        lines: dict[str, int] = {}
        while not self.loader.check_event(E.MappingEndEvent):
            kev = self.loader.get_event()
            kline = kev.start_mark.line + 1
            self._refuse_shared(kev, path, kline)
            key = self._scalar(kev, path, kline) if isinstance(kev, E.ScalarEvent) else kev
            if key == "<<" and kev.implicit[0]:
                raise ConfigError(f"{_where(path, kline)}: the YAML merge key << is not accepted", hint=_NO_ALIAS_HINT)
            if not isinstance(key, str):
                what = ("a list" if isinstance(key, E.SequenceStartEvent) else "a mapping"
                        if isinstance(key, E.MappingStartEvent) else f"{kev.value!r} (read as {shown(key)})")
                raise ConfigError(f"{_where(path, kline)}: the key {what} is not a string",
                                  hint="keys are names: quote a key that YAML reads as a number, true/false or null")
            sub = _key_path(path, key)
            self.pos[sub] = (kline, kev.start_mark.column + 1)
            if key in lines:
                raise ConfigError(f"{sub}: duplicate key at lines {lines[key]} and {kline}",
                                  hint="keep one of the two (YAML would silently take the last)")
            lines[key] = kline
            out[key] = self._node(sub, depth + 1)
        self.loader.get_event()
        return out

    def _scalar(self, ev: Any, path: str, line: int) -> Any:
        v = ev.value
        if ev.tag in ("!", _STR_TAG) or (ev.tag is None and not ev.implicit[0]):  # quoted, block or !!str
            return v
        self._tag(ev, path, line, _STR_TAG)  # any other tag
        if v in _NULLS:
            return None
        if v in _BOOLS:
            return _BOOLS[v]
        if _INT_RE.fullmatch(v):
            if len(v) > MAX_INT_DIGITS:
                raise ConfigError(f"{_where(path, line)}: {v[:12]}... ({len(v.lstrip('-'))} digits) is out of range "
                                  f"for every setting")
            return int(v)
        if _FLOAT_RE.fullmatch(v):
            return float(v)
        return _FLOAT_WORDS.get(v, v)


def read(text: str, *, source: str = "config", places: dict[str, tuple[int, int]] | None = None) -> Any:
    """The YAML document in `text` as plain dicts, lists and scalars, or a ConfigError naming `source` (see the
    module's doc for what is refused). `places`, when given, receives each key path's (line, column): of its key,
    or of its value in a list; filled as far as the read got, so a refusal can be placed too (see place)."""
    reader = _Reader(text, source)
    if places is not None:
        reader.pos = places
    return reader.compose()


_ERR_PATH_RE = re.compile(r"(?P<path>[A-Za-z0-9_<>.\[\]-]*?)(?: \(line (?P<line>\d+)\))?: (?P<msg>.*)", re.S)
_UNKNOWN_KEY_RE = re.compile(r"unknown key '(?P<key>[^']*)'(?P<top> at the top level)?")


def place(exc: ConfigError, name: str, pos: dict[str, tuple[int, int]], text: str = "") -> ConfigError:
    """`exc` as `FILE:LINE:COLUMN: key: message`, like a compiler's error: the position of the key the message
    names (an unknown key's own position; a missing key's mapping), from the places read() filled. The message is
    `KEY.PATH: ...`, `KEY.PATH (line N): ...` (the reader's own), `unknown key 'K' at the top level` or already
    `NAME:...` (then it is returned as it is)."""
    msg = exc.message
    if msg.startswith(name + ":"):
        return exc  # the reader placed it already
    m = _ERR_PATH_RE.fullmatch(msg)
    path, msg_text = (m["path"], m["msg"]) if m and (m["path"] or m["line"]) else ("", msg)
    unknown = _UNKNOWN_KEY_RE.match(msg_text)
    where = _key_path(path, unknown["key"]) if unknown else path
    if unknown and unknown["top"]:
        path, where = "", unknown["key"]
    loc = None
    probe = where
    while loc is None:
        loc = pos.get(probe)
        if loc is not None or not probe:
            break
        shorter = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", probe)
        probe = shorter if shorter != probe else ""  # up to the parent key; a path it cannot shorten: no place
    if m and m["line"] and (loc is None or loc[0] != int(m["line"])):  # the reader's own line (a key's) wins
        n = int(m["line"])
        row = text.split("\n")[n - 1] if 0 < n <= text.count("\n") + 1 else ""
        loc = (n, len(row) - len(row.lstrip()) + 1)
    head = f"{name}:{loc[0]}:{loc[1]}" if loc else name
    return ConfigError(f"{head}: {path + ': ' if path else ''}{msg_text}", hint=exc.hint,
                       details={"file": name, "line": loc[0] if loc else None, "column": loc[1] if loc else None,
                                "key": where or None})
