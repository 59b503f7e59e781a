"""Bounded metric labels for tenants (who a request is for: ``tenants.py`` reads it).

Tenants are client-chosen strings: a metric label per tenant would let clients grow the
label set without bound. ``TenantLabels`` keeps it bounded: the first ``max_labels``
tenants seen get a label of their own, every later one (and any name that is not a short
plain identifier) folds into ``"other"``; a request that names none is ``"none"``.
"""

from __future__ import annotations

import re
import threading

NO_TENANT = "none"
OTHER_TENANT = "other"
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")


class TenantLabels:
    """A bounded set of metric label values for tenants. Thread-safe."""

    def __init__(self, max_labels: int = 16) -> None:
        self.max_labels = max_labels
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if not _LABEL_RE.match(tenant) or tenant in (NO_TENANT, OTHER_TENANT):
            return OTHER_TENANT
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.max_labels:
                self._known.add(tenant)
                return tenant
        return OTHER_TENANT
