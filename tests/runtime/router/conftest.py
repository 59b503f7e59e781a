"""Router tests: the router app in front of fake workers (fast) or real ``arbor serve``
processes on the tiny test model (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: the live-server helpers live with the server tests; tests/ has no packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
