"""The bounded YAML reader (deploy_tool/yamlread.py) on its own: what it reads, what it refuses and where it says
the refusal is. The whole loader through it (config.load, hostile files, every setting) is test_config_loader.py's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool import config, yamlread
from deploy_tool.errors import ConfigError
from tests.support.examples import examples

MIN = "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\n"


# any character but lone surrogates and the three Unicode line breaks, which PyYAML's emitter writes raw where
# every YAML reader (PyYAML's own included) then reads a line break: yaml.safe_load(yaml.safe_dump({"\x85": 1},
# allow_unicode=True)) == {" ": 1}
_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x85\u2028\u2029")
_plain_keys = st.text(_chars, min_size=1, max_size=12)
_plain_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=False, allow_infinity=False),
              st.text(_chars, max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_plain_keys, inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=examples(300), deadline=timedelta(seconds=2))
@given(_plain_values)
def test_what_pyyaml_writes_reads_back_unchanged(doc: Any) -> None:
    """The strict scalar rules stay inside what PyYAML's resolver reads: whatever yaml.safe_dump writes (the tests,
    the bench scripts and any tool that edits a config with PyYAML) parses back to the same types and values."""
    text = yaml.safe_dump(doc, allow_unicode=True)
    assert yamlread.read(text) == doc
    assert yamlread.read(yaml.safe_dump(doc, default_flow_style=True)) == doc


@pytest.mark.parametrize("text", [config.example_text(n) for n in config.EXAMPLES] + [
    MIN + "    extra_args: [&a x, *a]\n", MIN + "    model: /n\n", MIN + "    tp: !!int 2\n", MIN + "---\nx: 1\n",
    MIN + "    env:\n      1: x\n", MIN + "    extra_args: " + "[" * 40 + "]" * 40 + "\n",
    MIN + "    tp: " + "9" * 200 + "\n", MIN + "    env: {A: yes, B: 0x1F, C: 1e3, D: 1.5e+3, E: ~, F: .inf, G: -0}\n"],
    ids=[*config.EXAMPLES, "alias", "duplicate", "tag", "two-documents", "int-key", "deep", "huge-int", "scalars"])
def test_pure_python_parser_gives_the_same_answers(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without libyaml (a PyYAML built without it) the loader falls back to PyYAML's own event parser: the same
    document, or a ConfigError with the same message (syntax errors aside, whose wording is the parser's)."""
    def answer() -> Any:
        try:
            return yamlread.read(text)
        except ConfigError as exc:
            return exc.message

    with_c = answer()
    monkeypatch.delattr(yaml, "CSafeLoader")
    assert answer() == with_c


def test_places_name_each_key_and_each_list_value() -> None:
    places: dict[str, tuple[int, int]] = {}
    doc = yamlread.read("a:\n  b: 1\n  c:\n    - x\n    - y\nodd key: 2\n", source="f.yaml", places=places)
    assert doc == {"a": {"b": 1, "c": ["x", "y"]}, "odd key": 2}
    assert places["a"] == (1, 1) and places["a.b"] == (2, 3) and places["a.c"] == (3, 3)
    assert places["a.c[0]"] == (4, 7) and places["a.c[1]"] == (5, 7)
    assert places["['odd key']"] == (6, 1)


@pytest.mark.parametrize("text, message", [
    ("a: &x 1\nb: *x\n", "a (line 1): the YAML anchor &x is not accepted"),
    ("a: !!binary aGk=\n", "a (line 1): the YAML tag !!binary is not accepted"),
    ("a: 1\na: 2\n", "a: duplicate key at lines 1 and 2"),
    ("1: x\n", "line 1: the key '1' (read as 1) is not a string"),
    ("a: 1\n---\nb: 2\n", "f.yaml:2:1: a second YAML document; a config is one document"),
    ("a: [1\n", "f.yaml:2:1: malformed YAML: "),  # the rest is the parser's wording
    ("a: " + "[" * 20 + "]" * 20 + "\n", "a[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0] (line 1): nested deeper than 16 "
                                          "levels"),
])
def test_refusals_name_the_key_path_or_the_place(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        yamlread.read(text, source="f.yaml")
    assert exc.value.message == message or message.endswith(": ") and exc.value.message.startswith(message)


def test_place_puts_file_line_and_column_before_the_key_path() -> None:
    text = "top:\n  inner: 1\n"
    places: dict[str, tuple[int, int]] = {}
    yamlread.read(text, source="f.yaml", places=places)
    placed = yamlread.place(ConfigError("top.inner: 1 is not a string"), "f.yaml", places, text)
    assert placed.message == "f.yaml:2:3: top.inner: 1 is not a string"
    assert placed.details == {"file": "f.yaml", "line": 2, "column": 3, "key": "top.inner"}
    unknown = yamlread.place(ConfigError("top: unknown key 'inner'"), "f.yaml", places, text)
    assert unknown.message == "f.yaml:2:3: top: unknown key 'inner'"
    missing = yamlread.place(ConfigError("top.gone: missing"), "f.yaml", places, text)  # the parent's place
    assert missing.message == "f.yaml:1:1: top.gone: missing"
    already = ConfigError("f.yaml:9:9: placed")
    assert yamlread.place(already, "f.yaml", places, text) is already


def test_places_are_filled_up_to_a_refusal() -> None:
    places: dict[str, tuple[int, int]] = {}
    with pytest.raises(ConfigError):
        yamlread.read("a: 1\nb:\n  c: 2\n  c: 3\n", source="f.yaml", places=places)
    assert places["b.c"] == (4, 3)


def test_shown_spells_values_as_yaml_and_keeps_them_short() -> None:
    assert [yamlread.shown(v) for v in (None, True, False, float("nan"), float("-inf"), "x")] == \
        ["null", "true", "false", ".nan", "-.inf", "'x'"]
    assert yamlread.shown(10 ** 300) == "an integer of 301 digits"
    assert yamlread.shown("y" * 100).endswith("...") and len(yamlread.shown("y" * 100)) == 60
