"""load_callable and --validate's binding checks: every failure names the dotted path."""

from __future__ import annotations

import pytest

from runner.errors import ExtensionError
from runner.extensions import call_factory, check_binds, load_callable


def error_line(dotted: str) -> str:
    with pytest.raises(ExtensionError) as info:
        load_callable(dotted, key="data.factory")
    (line,) = info.value.lines()
    assert line.startswith(f"data.factory: {dotted}: "), line
    return line


def test_loads_function_and_nested_attribute():
    assert load_callable("tests.extmods.callables.two_kwargs")(count=3) == [0, 1, 2]
    assert load_callable("tests.extmods.callables.Outer.Inner.build")() == "inner"
    assert load_callable("os.path.join")("a", "b") == "a/b"


def test_module_not_found():
    assert "no module named 'no'" in error_line("no.such.module.fn")


def test_attribute_missing():
    line = error_line("tests.extmods.callables.nope")
    assert "'tests.extmods.callables' has no attribute 'nope'" in line


def test_nested_attribute_missing():
    assert "has no attribute 'Missing'" in error_line("tests.extmods.callables.Outer.Missing")


def test_not_callable():
    assert "is a int, not a callable" in error_line("tests.extmods.callables.NOT_CALLABLE")


def test_exception_while_importing():
    line = error_line("tests.extmods.broken_import.fn")
    assert "raised ValueError: broken at import time" in line


def test_missing_dependency_of_existing_module_is_not_reported_as_missing_module():
    line = error_line("tests.extmods.bad_dependency.fn")
    assert "importing 'tests.extmods.bad_dependency' failed" in line
    assert "definitely_not_installed_pkg" in line


def test_not_a_dotted_path():
    assert "is not a dotted path" in error_line("justaname")


def test_binding_checks_kwargs():
    fn = load_callable("tests.extmods.callables.two_kwargs")
    check_binds(fn, "x.two_kwargs", key="data.factory", kwargs={"count": 3})
    with pytest.raises(ExtensionError) as info:
        check_binds(fn, "x.two_kwargs", key="data.factory", kwargs={"cnt": 3})
    assert "unexpected keyword argument 'cnt'" in info.value.lines()[0]
    assert "two_kwargs(count: int = 10, name: str = 'x')" in info.value.lines()[0]


def test_call_factory_wraps_exceptions():
    with pytest.raises(ExtensionError) as info:
        call_factory("tests.extmods.callables.raises", key="data.factory")
    assert "raised RuntimeError when called: factory exploded" in info.value.lines()[0]
