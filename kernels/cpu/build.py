"""Compile the C kernels of this folder once per machine and load them with ctypes.

A kernel is one C file (plus this folder's headers, and for the fused decode step the
other kernels' files; no Python or torch headers), so a build is a single ``cc`` call of
a second or two. The shared library is cached under the caller's cache
directory, named by a hash of the source, the flags, the compiler and the CPU's feature
flags (``-march=native`` code must not run on another CPU); a build goes to a temporary
file first and is renamed into place, so concurrent processes never load a half-written
library. OpenMP comes from the libgomp that torch has already loaded (same soname), so
the kernels and torch share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
          "-shared", "-fPIC", "-Wall", "-Werror")


class NativeBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeBuildError("no C compiler found (install gcc, or set CC)")
    return cc


def build_library(
    name: str, cache_dir: Path, defines: tuple[str, ...] = (), with_sources: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """Compile ``<name>.c`` (if not cached) and load it; ``defines`` (``"NAME"`` or
    ``"NAME=VALUE"``) become ``-D`` flags, e.g. to force a kernel's portable path in tests;
    ``with_sources`` names other kernels of this folder compiled into the same library
    (the fused decode step calls their serial pieces, declared in ``arbor_cpu.h``).

    Raises:
        NativeBuildError: no compiler, a failed compile, or a library that won't load.
    """
    sources = [SOURCE_DIR / f"{n}.c" for n in (name, *with_sources)]
    cc = _compiler()
    flags = (*CFLAGS, *(f"-D{d}" for d in defines))
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    for part in (*(s.read_bytes() for s in sources), *headers, " ".join(flags).encode(), cc.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
    target = cache_dir / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise NativeBuildError(f"{cc} failed on {name}.c:\n{done.stderr.strip()}")
            os.replace(tmp, target)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeBuildError(f"could not run {cc}: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"could not load {target}: {exc}") from exc
