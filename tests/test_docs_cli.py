"""Every ``evflow ...`` command line in README.md and docs/*.md names a sub-command and
options the command-line parser has: the docs cannot promise what is not there.

Command lines are read from fenced code blocks (lines starting with ``evflow``,
``$ evflow`` or ``python -m evflow``, with ``\\`` continuations) and from inline code
spans starting with ``evflow ``. Each option (a token starting with ``-``, up to a
``--`` separator) must be an option of the parser of that (sub-)command; a device
class's options come from ``evflow device CLASS``'s own parser.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from evflow.cli import build_parser
from evflow.runtime.device import Device
from evflow.runtime.runner import build_parser as device_parser
from evflow.runtime.runner import load_device_class

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINE_START = re.compile(r"^\s*(?:\$\s+)?(?:python3? -m )?(evflow\s.*)$")
SPAN = re.compile(r"`(evflow [^`]+)`")


def command_lines(text: str) -> list[str]:
    """The ``evflow ...`` command lines of one markdown text (see the module doc)."""
    found: list[str] = []
    in_code = False
    pending = ""
    prose: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose.append(line)
            continue
        if pending:
            pending += " " + line.strip()
        else:
            m = LINE_START.match(line)
            if m is None:
                continue
            pending = m.group(1)
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        found.append(pending.split(" #", 1)[0])
        pending = ""
    for m in SPAN.finditer(" ".join(prose)):  # (a span may be wrapped over two lines)
        found.append(m.group(1))
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _tokens(line: str) -> list[str]:
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    # usage forms: [-n N], --control static|interactive
    return [w.strip("[]") for w in words if w.strip("[]")]


def problems_of(line: str, doc_text: str) -> list[str]:
    """What in one ``evflow ...`` line the parser does not have (empty: all there)."""
    words = _tokens(line)[1:]
    parser = build_parser()
    path = ["evflow"]
    found: list[str] = []
    while words:
        word = words.pop(0)
        if word == "--":
            break  # the rest goes to the steering file
        if word.strip(".") == "":
            continue  # "...": and so on
        subs = _subparsers(parser)
        if word in subs:
            parser = subs[word]
            path.append(word)
            if word == "device" and path == ["evflow", "device"]:
                parser = _device_parser(words)
            continue
        if subs and not word.startswith("-"):
            have = ", ".join(sorted(subs))
            return [f"'{' '.join(path)} {word}' is not a sub-command (have: {have})"]
        if not word.startswith("-") or word == "-" or re.fullmatch(r"-\d+(\.\d+)?", word):
            continue  # a value, a positional or a placeholder
        option = word.split("=", 1)[0]
        if option.lstrip("-").isupper():
            continue  # a placeholder such as --PARAM
        if option not in parser._option_string_actions and not _doc_param(option, doc_text):
            found.append(f"'{' '.join(path)}' has no option {option}")
    return found


def _device_parser(words: list[str]) -> argparse.ArgumentParser:
    """``evflow device CLASS``'s parser: a built-in class's own, else the base options."""
    cls: type = Device
    if words and not words[0].startswith("-"):
        name = words.pop(0)
        try:
            cls = load_device_class(name)
        except Exception:
            cls = Device  # a placeholder (CLASS, module:Class) or the docs' own example
    return device_parser(cls, "CLASS")


def _doc_param(option: str, doc_text: str) -> bool:
    """An option of a device class the same doc defines (``factor = Param(...)``)."""
    name = option.lstrip("-").replace("-", "_")
    return re.search(rf"\b{re.escape(name)} = Param\(", doc_text) is not None


def all_command_lines() -> list[tuple[str, str]]:
    return [
        (f"{doc.relative_to(ROOT)}: {line}", line)
        for doc in DOCS
        for line in command_lines(doc.read_text())
    ]


def test_the_docs_name_command_lines_at_all() -> None:
    lines = [line for _, line in all_command_lines()]
    assert len(lines) > 20  # the extraction works: README and docs show many commands
    assert any(line.startswith("evflow ctl get-metrics") for line in lines)
    assert any(line.startswith("evflow device sampler") for line in lines)


@pytest.mark.parametrize(("where", "line"), all_command_lines(), ids=lambda v: v[:60])
def test_every_documented_command_line_exists_in_the_parser(where: str, line: str) -> None:
    doc = ROOT / where.split(":", 1)[0]
    assert problems_of(line, doc.read_text()) == [], where


def test_the_checker_catches_what_the_parser_lacks() -> None:
    assert problems_of("evflow teleport topology.toml", "") != []
    assert problems_of("evflow run steer.py --no-such-option", "") != []
    assert problems_of("evflow ctl get-runs", "") != []
    assert problems_of("evflow ctl get-metrics input --nope", "") != []
    assert problems_of("evflow device sampler --id s --msg-size 10", "") == []
    assert problems_of("evflow device sampler --msg-sizes 10", "") != []
    assert problems_of("evflow run steer.py -o X -- --outdir D", "") == []


def test_the_device_bus_option_is_written_as_the_docs_write_it() -> None:
    # the docs say --bus PUB,SUB (and the parser accepts ',' or ';'): so does --help
    bus = device_parser(Device, "CLASS")._option_string_actions["--bus"]
    assert bus.metavar == "PUB,SUB"
    ctl = _subparsers(build_parser())["ctl"]._option_string_actions["--bus"]
    assert ctl.metavar == "PUB,SUB"
