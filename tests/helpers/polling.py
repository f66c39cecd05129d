"""The one polling helper: for what a test cannot be told, only see."""

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], timeout: float, what: str | Callable[[], str], interval: float = 0.1
) -> None:
    """Polls ``condition`` every ``interval`` seconds until it holds.

    Args:
      what: names the condition in the error; a callable is called at the timeout, so the error can
        show the value that fell short.

    Raises:
      TimeoutError: ``condition`` did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what() if callable(what) else what} not reached within {timeout} s")
        time.sleep(interval)
