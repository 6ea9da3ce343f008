"""The check registry: every registered check module says in its docstring what it compares, at
which tolerance and which bug classes its hypotheses name; the README's example causes are
wording some check can actually produce (so the README and the checks cannot drift)."""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest
import regex

from dflash_audit.audit.checks import CHECKS, REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"
#: Stands for a formatted value (an f-string placeholder) in a rendered wording template.
HOLE = "\x00"


def test_registry_lists_every_check_once_in_report_order():
    names = [c.name for c in REGISTRY]
    assert names == ["protocol", "structure", "derivation", "defaults", "mask", "context",
                     "targets", "logits", "loss", "gradients", "metrics", "anchors"]
    assert [n for n, _ in CHECKS] == names
    modules = sorted(p.stem for p in Path(REGISTRY[0].module.__file__).parent.glob("*.py"))
    assert sorted(c.module.__name__.rsplit(".", 1)[1] for c in REGISTRY) == [
        m for m in modules if m != "__init__"]  # no check module left out of the registry


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda c: c.name)
def test_check_module_docstring_says_what_tolerance_and_causes(entry):
    doc = inspect.getdoc(entry.module) or ""
    assert doc.startswith(f"The ``{entry.name}`` check: "), doc[:80]
    assert re.search(r"\b(tolerance|exact)\b", doc), f"{entry.name}: no tolerance stated"
    assert re.search(r"\bHypotheses\b.*?\bname\b", doc, flags=re.S), \
        f"{entry.name}: the docstring does not say which causes its hypotheses name"
    assert entry.check.__module__ == entry.diagnose.__module__ == entry.module.__name__


def _templates(module: ModuleType) -> list[str]:
    """Every string literal and f-string of a module, placeholders rendered as HOLE."""
    tree = ast.parse(inspect.getsource(module))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else HOLE
                               for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def _wording_modules() -> set[ModuleType]:
    """The check modules and the audit modules their hypotheses come from (e.g. the draft-layer
    hypotheses of the logits check live in dflash_audit.audit.replay.architecture)."""
    mods = set()
    for entry in REGISTRY:
        mods.add(entry.module)
        for obj in vars(entry.module).values():
            home = inspect.getmodule(obj)
            if home is not None and home.__name__.startswith("dflash_audit.audit."):
                mods.add(home)
    return mods


TEMPLATES = [t for m in _wording_modules() for t in _templates(m) if len(t) > 8]


def _pattern(template: str) -> str:
    """A template as a regex: literal text, each placeholder one or more non-blank chars."""
    return "".join(r"\S+" if part == HOLE else regex.escape(part)
                   for part in re.split(f"({HOLE})", template) if part)


def can_word(piece: str) -> bool:
    """Whether some template, started at one of its words, renders text that begins with
    ``piece`` (a cause is quoted from the start of a phrase; it may stop mid-sentence)."""
    return any(_renders(t[s:], piece) for t in TEMPLATES
               for s in [0] + [m.end() for m in re.finditer(r"[\s(]", t)] if t[s:])


def _renders(suffix: str, piece: str) -> bool:
    """Whether the template text ``suffix`` renders text that begins with ``piece``: ``piece``
    ends inside its literal head, or goes on past it into a placeholder (then the regex of
    :func:`_pattern`, compiled once)."""
    head = suffix.split(HOLE, 1)[0]
    if head.startswith(piece):
        return True
    return HOLE in suffix and piece.startswith(head) and bool(
        _compiled(suffix).fullmatch(piece, partial=True))


@functools.lru_cache(maxsize=None)
def _compiled(suffix: str) -> regex.Pattern:
    return regex.compile(_pattern(suffix))


def readme_causes() -> list[str]:
    """The quoted causes of the README's list "Each failing check gets a named cause. For
    example: ..." (up to the blank line that ends the list)."""
    text = README.read_text(encoding="utf-8")
    intro = "Each failing check gets a named cause. For example:\n\n"
    start = text.index(intro) + len(intro)
    block = text[start:text.index("\n\n", start)]
    return re.findall(r'"([^"]+)"', block.replace("\n  ", " "))


def test_readme_lists_example_causes():
    causes = readme_causes()
    assert len(causes) >= 8 and "context rule kv <= anchor" in causes


@pytest.mark.parametrize("cause", readme_causes())
def test_readme_cause_is_wording_of_a_check(cause):
    pieces = [p.strip() for p in cause.split("...") if p.strip()]
    missing = [p for p in pieces if not can_word(p)]
    assert not missing, f"README cause {cause!r}: no check module words {missing}"


@pytest.mark.parametrize("made_up", [
    "fc fed 4 of 5 bananas", "decay gamma seven and a half", "context rule kv >= anchor",
    "targets from the wrong planet"])
def test_matching_is_not_vacuous(made_up):
    assert not can_word(made_up)
