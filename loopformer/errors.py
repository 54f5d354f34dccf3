"""User-facing errors.

`UserError` marks a problem with what the user gave us (a bad config value, a missing or malformed file, an
out-of-vocabulary token, a sequence that is too long). The command line prints its message as one line and exits
with status 2; library callers can catch it like any `ValueError`.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input; the CLI prints `loopformer: error: <message>` and exits 2."""
