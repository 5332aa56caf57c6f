"""Suite-wide pytest hooks."""

from tests.teardown_guard import pytest_runtest_teardown  # noqa: F401  (a hung teardown ends the run, named)
