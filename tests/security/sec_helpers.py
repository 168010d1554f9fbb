"""Helpers of the security tests."""

from __future__ import annotations

from contextlib import contextmanager

import nbd


@contextmanager
def connect(uri: str):
    """An open libnbd handle on `uri`, which may be an `nbds://` URI naming
    its key file (libnbd reads such local files only when allowed)."""
    h = nbd.NBD()
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    try:
        yield h
    finally:
        try:
            h.shutdown()
        except nbd.Error:
            pass
