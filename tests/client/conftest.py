"""Fixtures of the client's end-to-end tests: donors for a client, and
clients driven through pagerctl (netpager_testkit.client_fixtures)."""

from netpager_testkit.client_fixtures import client, client_built, donors  # noqa: F401
