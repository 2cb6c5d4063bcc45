"""Replica states as enums (str values, used as metrics labels and in logs)."""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """Members are their str values (metrics labels, logs, JSON); enum.StrEnum itself needs Python 3.11."""

    def __str__(self) -> str:
        return self.value


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class KVEventsState(StrEnum):
    """A replica's KV event stream, as router/routing/kv_events.py reports it."""

    CONNECTING = "connecting"  # not synced yet (or resyncing)
    LIVE = "live"  # snapshot applied, events flowing
    UNAVAILABLE = "unavailable"  # the replica has no KV event endpoint (e.g. a third-party engine)
