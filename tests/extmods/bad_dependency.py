"""A module that exists but imports a module that does not."""

import definitely_not_installed_pkg  # noqa: F401


def fn() -> None:
    return None
