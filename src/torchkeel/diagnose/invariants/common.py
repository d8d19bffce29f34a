"""What the invariant families share."""

from __future__ import annotations

ANY = "*"
"""In ``EXPLAINED_BY``: any named error or warning explains this invariant finding."""
