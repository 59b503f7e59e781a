"""Where a rollout's state and its event log live: one SQLite file, so a router that
restarts resumes where it was (same step, same hold after a rollback) instead of sending
the candidate its first share again. Torch-free.

Two tables: ``state`` (one row per plan digest: the state machine's fields) and
``events`` (append-only: rollbacks with their gate and figures, promotions, pauses).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from typing import Any, Literal

StateName = Literal["progressing", "paused", "rolled_back", "completed"]
SCHEMA = """
CREATE TABLE IF NOT EXISTS state (plan TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL,
    kind TEXT NOT NULL, step INTEGER NOT NULL, weight INTEGER NOT NULL, detail TEXT NOT NULL);
"""


@dataclass
class RolloutState:
    """The state machine's fields (``rollout.Rollout`` is the only writer)."""

    state: StateName = "progressing"
    step_idx: int = 0
    step_started: float = 0.0  # clock time the step began (wall time with the real clock)
    weight_override: int | None = None  # the candidate's percent set through the API (a controller)
    failed_checks: int = 0  # gate checks in a row with a failure
    reason: str | None = None  # why it was last rolled back or paused


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "start", "advance", "rollback", "promote", "pause", "resume", "set_weight", "complete"
    step: int
    weight: int  # the candidate's percent after the event
    detail: dict[str, Any]  # for a rollback: the gate, its value, bound and sample count


class RolloutStore:
    """The SQLite file (``":memory:"``: nothing kept, for tests and ``--rollout-db none``)."""

    def __init__(self, path: str) -> None:
        # NOTE: every call comes from the router's event loop; the flag only lets the
        # connection be created on another thread (the app is built before the loop runs).
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.executescript(SCHEMA)

    def load(self, plan: str) -> RolloutState | None:
        row = self.db.execute("SELECT body FROM state WHERE plan = ?", (plan,)).fetchone()
        return RolloutState(**json.loads(row[0])) if row else None

    def save(self, plan: str, state: RolloutState) -> None:
        self.db.execute("INSERT OR REPLACE INTO state (plan, body) VALUES (?, ?)", (plan, json.dumps(asdict(state))))

    def add_event(self, event: Event) -> None:
        self.db.execute("INSERT INTO events (t, kind, step, weight, detail) VALUES (?, ?, ?, ?, ?)",
                        (event.t, event.kind, event.step, event.weight, json.dumps(event.detail)))

    def events(self, limit: int = 100) -> list[Event]:
        """The last ``limit`` events, oldest first."""
        rows = self.db.execute("SELECT t, kind, step, weight, detail FROM events ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [Event(t, kind, step, weight, json.loads(detail)) for t, kind, step, weight, detail in reversed(rows)]

    def close(self) -> None:
        self.db.close()
