"""The layers' import rules (pyproject.toml's import-linter contracts, docs/layout.md) hold,
and a broken rule is reported: the checker is run in process on the real code."""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from importlinter.cli import EXIT_STATUS_ERROR, EXIT_STATUS_SUCCESS, lint_imports

from bench.paths import REPO_ROOT

BROKEN_RULE = """
[importlinter]
root_packages =
    engine
    serving

[importlinter:contract:serving-without-engine]
name = serving may not import engine (false: it does)
type = forbidden
source_modules = serving
forbidden_modules = engine
"""


@pytest.fixture
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """At the checkout's root, with logging as it was: the checker configures logging for
    its own output, which disabled every existing logger (so later tests' caplog saw
    nothing)."""
    monkeypatch.chdir(REPO_ROOT)
    loggers = [logging.getLogger(name) for name in logging.root.manager.loggerDict]
    disabled = {logger: logger.disabled for logger in loggers}
    handlers, level = list(logging.root.handlers), logging.root.level
    yield
    for logger, was_disabled in disabled.items():
        logger.disabled = was_disabled
    logging.root.handlers[:], logging.root.level = handlers, level


def test_every_layer_keeps_its_import_rules(at_repo_root) -> None:
    assert lint_imports(config_filename="pyproject.toml", no_cache=True) == EXIT_STATUS_SUCCESS


def test_a_broken_rule_fails_the_check(at_repo_root, tmp_path: Path) -> None:
    config = tmp_path / "broken.ini"
    config.write_text(BROKEN_RULE)
    assert lint_imports(config_filename=os.fspath(config), no_cache=True) == EXIT_STATUS_ERROR


@pytest.mark.parametrize("package", ["bench", "testing", "serving", "engine", "small_model"])
def test_no_module_reaches_into_tests(package: str) -> None:
    """tests/ is not a package: a module importing from it would need sys.path edits."""
    for path in (REPO_ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), path
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "tests", path
