"""Bounded polling for tests: every wait ends by itself."""
from __future__ import annotations

import time


def wait_for(predicate, timeout: float, interval: float = 1.0, what: str = ""):
    """Poll ``predicate`` every ``interval`` s for at most ``timeout`` s; its first truthy value.
    On timeout: with ``what``, an AssertionError naming it; without, the last value (falsy), so the
    caller's assert can say more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    if what:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return predicate()
