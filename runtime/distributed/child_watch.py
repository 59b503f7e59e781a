"""Watching the processes the engine starts (tensor-parallel ranks, data-parallel workers):
what a child wrote to stderr last, and one message that says how it ended and what to do.

A child that dies while its parent waits for it (a rendezvous, a health probe) must fail
the wait at once, with its exit code and the tail of its stderr, rather than leave the
parent waiting out a timeout with nothing said.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TAIL_LINES = 20

# What the `spawn` start method prints when a child cannot re-import the parent's main
# module: a main read from stdin (`python -`) has no file to import, and an unguarded main
# starts the children again from inside a child.
_SPAWN_MARKERS = ("bootstrapping phase", "<stdin>", "freeze_support()")
SPAWN_HINT = ("the rank processes are started with the 'spawn' method, which re-imports the "
              "program's main module: run the program from a file (not `python -` or a pipe) "
              'and put its entry point under `if __name__ == "__main__":`')


def main_is_importable() -> bool:
    """Whether a `spawn` child can re-import this process's main module (a file, or none
    at all as in a REPL), rather than a ``<stdin>``-like pseudo path."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None):
        return True
    return os.path.isfile(path)


def exit_message(who: str, exit_code: int | None, stderr_tail: str, spawned: bool = False) -> str:
    """``who`` exited with ``exit_code``, its stderr's last lines, and the spawn hint when
    the tail (or this process's main module) says a `spawn` child could not start."""
    how = f"was killed by signal {-exit_code}" if exit_code is not None and exit_code < 0 \
        else f"exited with code {exit_code}"
    parts = [f"{who} {how}"]
    if spawned and (not main_is_importable() or any(m in stderr_tail for m in _SPAWN_MARKERS)):
        parts.append(f"hint: {SPAWN_HINT}")
    parts.append("its stderr ends with:\n" + (stderr_tail.rstrip() or "(nothing)"))
    return "; ".join(parts[:-1]) + "\n" + parts[-1]


def tail_of_file(path: Path, max_lines: int = TAIL_LINES, max_bytes: int = 8192) -> str:
    """The last ``max_lines`` lines of ``path`` (at most its last ``max_bytes``)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-max_lines:])


@contextmanager
def stderr_to_file(prefix: str) -> Iterator[Path]:
    """While inside, file descriptor 2 points at a new file (its path is yielded): a child
    started here (``multiprocessing`` spawn execs with the parent's descriptors) writes its
    stderr there from its first instruction on, so a failure before any of our code runs
    in it (re-importing the main module) is still on record.

    NOTE: process-wide for that short moment: keep only the ``start()`` calls inside.
    """
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)
        yield Path(name)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


class StderrTail:
    """Copies a child's stderr pipe to ours line by line and keeps its last lines."""

    def __init__(self, pipe: IO[bytes], name: str, max_lines: int = TAIL_LINES) -> None:
        self.lines: deque[str] = deque(maxlen=max_lines)
        self._pipe = pipe
        self._thread = threading.Thread(target=self._pump, name=f"{name}-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for raw in iter(self._pipe.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
            if out is not None:
                try:
                    out.write(raw)
                    out.flush()
                except (OSError, ValueError):  # our stderr closed: keep the tail anyway
                    out = None

    def text(self, wait_s: float = 1.0) -> str:
        """The kept lines; waits up to ``wait_s`` for the pipe to drain (the child exited)."""
        self._thread.join(wait_s)
        return "\n".join(self.lines)
