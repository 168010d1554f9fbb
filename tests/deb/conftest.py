"""Fixtures of the package tests: the packages, built once per session."""

from debroot import debs  # noqa: F401
