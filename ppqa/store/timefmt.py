"""Timestamps as the store's readers show them: ISO 8601 in UTC, to the second."""

from __future__ import annotations

from datetime import datetime


def iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.replace(microsecond=0).isoformat() + "Z"
