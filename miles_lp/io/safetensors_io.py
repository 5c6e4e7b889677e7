"""Safetensors I/O for the converter: header-only reads, per-tensor reads, a rolling shard writer.

The safetensors format is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the data
section. We parse the header ourselves so that a truncated file or a corrupt header is reported with the
file's name and what is wrong, before any byte of output is written.

Tensors are read one at a time with a positioned read into a fresh buffer (no memory map), so that the
converter's resident memory stays about one tensor of input plus one output shard, whatever the size of the
input shards. Output shards are written with ``safetensors.torch.save_file`` (which writes from the tensors'
own storage) and rolled over at ``max_shard_bytes``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from miles_lp.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype string -> (bytes per element, torch dtype name)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "U16": (2, "uint16"), "I16": (2, "int16"),
    "F16": (2, "float16"), "BF16": (2, "bfloat16"), "U32": (4, "uint32"), "I32": (4, "int32"),
    "F32": (4, "float32"), "U64": (8, "uint64"), "I64": (8, "int64"), "F64": (8, "float64"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, "float8_e8m0fnu"),
}
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the high-precision inputs the converter quantizes from
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces


def torch_dtype(st_dtype: str):
    import torch

    return getattr(torch, DTYPES[st_dtype][1])


def st_dtype(dtype) -> str:
    """torch dtype -> safetensors dtype string."""
    name = str(dtype).removeprefix("torch.")
    for key, (_, tname) in DTYPES.items():
        if tname == name:
            return key
    raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors")


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """Where one tensor lives: file, dtype (safetensors string), shape and absolute byte range."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class FileHeader:
    path: Path
    tensors: dict[str, TensorHeader]
    metadata: dict[str, str]
    size: int


def read_header(path: str | Path) -> FileHeader:
    """Parse and validate one safetensors file's header without reading its data.

    Raises ``CheckpointError`` naming the file for: a file shorter than its header, a header that is not
    JSON, unknown dtypes, offsets that do not match dtype x shape, overlapping tensors, or data past the end
    of the file (a truncated download).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header); "
                                      "re-download or re-save it")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (declares {n} header "
                                      f"bytes, file has {size}); re-download or re-save it")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {exc}); "
                              "re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, TensorHeader] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}': {info!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype!r}; "
                                  f"supported: {', '.join(DTYPES)}")
        expected = DTYPES[dtype][0] * math.prod(shape)
        if not (isinstance(b, int) and isinstance(e, int)) or e - b != expected or b < 0:
            raise CheckpointError(f"{path}: tensor '{name}' header is inconsistent: offsets [{b}, {e}] for "
                                  f"{dtype} {list(shape)} ({expected} bytes)")
        if e > data_len:
            raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {data_start + e} but the "
                                  f"file has {size} bytes; re-download or re-save it")
        spans.append((b, e, name))
        tensors[name] = TensorHeader(name, path, dtype, shape, data_start + b, data_start + e)
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CheckpointError(f"{path}: corrupt header: tensors '{n0}' and '{n1}' overlap")
    return FileHeader(path, tensors, dict(metadata), size)


def read_tensor(h: TensorHeader, fobj=None) -> torch.Tensor:
    """Read one tensor's bytes with a positioned read (no memory map) and view them as its dtype/shape."""
    import torch

    buf = torch.empty(h.nbytes, dtype=torch.uint8)
    own = fobj is None
    f = open(h.file, "rb", buffering=0) if own else fobj
    try:
        f.seek(h.begin)
        got = f.readinto(memoryview(buf.numpy())) if h.nbytes else 0
    finally:
        if own:
            f.close()
    if got != h.nbytes:
        raise CheckpointError(f"{h.file}: short read of tensor '{h.name}' ({got} of {h.nbytes} bytes): "
                              "the file is truncated or changed while reading")
    if h.dtype == "BOOL":
        return buf.view(torch.bool).reshape(h.shape)
    return buf.view(torch_dtype(h.dtype)).reshape(h.shape)


class TensorReader:
    """Reads tensors of a checkpoint, keeping at most one file open (opened lazily, closed on switch)."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._f = None

    def read(self, h: TensorHeader) -> torch.Tensor:
        if self._path != h.file:
            self.close()
            self._f = open(h.file, "rb", buffering=0)
            self._path = h.file
        return read_tensor(h, self._f)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f, self._path = None, None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class CheckpointFiles:
    """A folder of safetensors shards, its index (if any) and every tensor's header."""

    root: Path
    files: list[Path]  # in the index's (or sorted) order
    tensors: dict[str, TensorHeader]  # in file order, then offset order
    index: dict | None
    ignored: dict[Path, str] = dataclasses.field(default_factory=dict)  # other *.safetensors of root -> why not read

    @property
    def total_bytes(self) -> int:
        return sum(h.nbytes for h in self.tensors.values())

    def names_in_file(self, path: Path) -> list[str]:
        return [n for n, h in self.tensors.items() if h.file == path]

    def ignored_note(self) -> str:
        """``"a.safetensors (why); b.safetensors (why)"`` for the files not read, or ``""``."""
        return "; ".join(f"{p.name} ({why})" for p, why in self.ignored.items())


def weight_candidates(root: Path) -> list[Path]:
    """The folder's ``*.safetensors`` files, sorted; hidden ones (``._model.safetensors`` AppleDouble copies,
    editor temps) are never weights."""
    return sorted(p for p in root.glob("*.safetensors") if p.is_file() and not p.name.startswith("."))


def _names(paths: list[Path], limit: int = 6) -> str:
    shown = ", ".join(p.name for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def select_weight_files(root: str | Path) -> tuple[list[Path], dict[Path, str], dict | None]:
    """Which ``*.safetensors`` files of ``root`` are the model: ``(files, ignored {path: why}, index)``.

    The one rule every reader follows, the one Hugging Face transformers and vLLM agree on:

    1. ``model.safetensors.index.json``: exactly the shards its ``weight_map`` names (vLLM's
       ``filter_duplicate_safetensors_files``; transformers loads the index's files). A shard it names that is
       missing is an error naming the index and the shard. Other ``*.safetensors`` (Mistral's
       ``consolidated.safetensors`` next to the HF shards, a leftover copy) are not read.
    2. No index, ``model.safetensors``: that file alone (transformers' single-file checkpoint).
    3. No index, no ``model.safetensors``, exactly one ``*.safetensors``: that file.
    4. No index, no ``model.safetensors``, several: an error naming the folder and the files. A glob would mix
       foreign names (``consolidated.safetensors`` holds Mistral's native ``layers.0.attention.wq.weight``) or a
       second copy of every tensor into the model; transformers refuses such a folder (no ``model.safetensors``),
       vLLM would load every file (or, with a ``consolidated*.safetensors`` among them, only those, as Mistral's
       format).

    An index and a ``model.safetensors`` it does not name are an error too: transformers checks for
    ``model.safetensors`` first and would load it (our learner loads through transformers), vLLM and this
    converter the index's shards, so the two sides would hold different models.
    """
    root = Path(root)
    index_path = root / INDEX_NAME
    present = weight_candidates(root)
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: corrupt index (need a JSON object with a 'weight_map' "
                                  f"mapping): {exc}") from None
        files = list(dict.fromkeys(root / f for f in weight_map.values()))
        for f in files:
            if not f.exists():
                names = [n for n, v in weight_map.items() if root / v == f]
                raise CheckpointError(f"{index_path}: names shard '{f.name}' (for {len(names)} tensors, e.g. "
                                      f"'{names[0]}'), which does not exist in {root}")
        single = root / SINGLE_NAME
        if single.is_file() and single not in files:
            raise CheckpointError(
                f"{root}: holds both {INDEX_NAME} (naming {_names(sorted(files))}) and {SINGLE_NAME}, which the index does "
                f"not name: transformers would load {SINGLE_NAME}, vLLM and miles-lp the index's shards, so "
                f"which is the model is ambiguous; remove {SINGLE_NAME}, or the index and its shards")
        ignored = {p: f"weights not read: {INDEX_NAME} does not name them" for p in present if p not in files}
        return files, ignored, index
    if (root / SINGLE_NAME).is_file():
        files = [root / SINGLE_NAME]
        ignored = {p: f"weights not read: no {INDEX_NAME}, so the model is {SINGLE_NAME} alone, as transformers "
                      "loads it"
                   for p in present if p not in files}
        return files, ignored, None
    if not present:
        raise CheckpointError(f"{root}: no safetensors weights (neither {INDEX_NAME} nor *.safetensors); "
                              "convert from a Hugging Face checkpoint saved with safe_serialization")
    if len(present) > 1:
        mistral = [p.name for p in present if p.name.startswith("consolidated")]
        hint = (f" ({', '.join(mistral)} is Mistral's native format, with its own tensor names: vLLM reads it "
                "instead of the HF shards; miles-lp reads the HF shards)" if mistral else "")
        raise CheckpointError(
            f"{root}: {len(present)} *.safetensors files ({_names(present)}) and neither {INDEX_NAME} nor "
            f"{SINGLE_NAME}: cannot tell which files are the model{hint}. Add the {INDEX_NAME} that names the "
            "shards (save_pretrained writes it), or remove the files that are not part of the model")
    return present, {}, None


def open_checkpoint(root: str | Path) -> CheckpointFiles:
    """Read the model's shards' headers (``select_weight_files``: the index's shards, or ``model.safetensors``,
    or the one ``*.safetensors``) and check the index against the shards (names and files)."""
    root = Path(root)
    index_path = root / INDEX_NAME
    files, ignored, index = select_weight_files(root)
    tensors: dict[str, TensorHeader] = {}
    for f in files:
        fh = read_header(f)
        for name, h in sorted(fh.tensors.items(), key=lambda kv: kv[1].begin):
            if name in tensors:
                raise CheckpointError(f"tensor '{name}' is stored twice: in {tensors[name].file.name} and "
                                      f"{f.name}")
            tensors[name] = h
    if index is not None:
        for name, fname in index["weight_map"].items():
            h = tensors.get(name)
            if h is None or h.file != root / fname:
                raise CheckpointError(f"{index_path}: names tensor '{name}' in '{fname}', but that shard has "
                                      "no such tensor; the checkpoint is incomplete or its index is stale")
        extra = [n for n in tensors if n not in index["weight_map"]]
        if extra:
            raise CheckpointError(f"{index_path}: shards hold {len(extra)} tensors the index does not name "
                                  f"(e.g. '{extra[0]}'); the index is stale")
    return CheckpointFiles(root, files, tensors, index, ignored)


class ShardWriter:
    """Collects output tensors and writes a shard whenever the next tensor would exceed ``max_shard_bytes``.

    Shards are written as ``model-XXXXX.safetensors`` and renamed to the Hugging Face names
    ``model-XXXXX-of-YYYYY.safetensors`` by ``finish()``, which also writes the index
    (``weight_map`` + ``metadata.total_size``). A single tensor larger than the limit gets a shard of its own.
    ``save`` is the function that writes one shard (``safetensors.torch.save_file`` signature).
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int, save=None) -> None:
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # names per written shard
        self.total_bytes = 0
        self.bytes_written = 0  # file bytes, headers included
        self._save = save
        self._names: set[str] = set()

    @staticmethod
    def _nbytes(t) -> int:
        return t.numel() * t.element_size()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise CheckpointError(f"internal: output tensor '{name}' written twice")
        self._names.add(name)
        n = self._nbytes(tensor)
        if self._pending and self._pending_bytes + n > self.max_shard_bytes:
            self.flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += n

    def add_many(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.add(name, t)

    def flush(self) -> None:
        if not self._pending:
            return
        save = self._save
        if save is None:
            from safetensors.torch import save_file as save
        path = self.out_dir / f"model-{len(self._shards) + 1:05d}.safetensors"
        try:
            save(self._pending, str(path), metadata={"format": "pt"})
        except OSError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError, not OSError
            raise as_os_error(exc, path) from exc
        self.bytes_written += path.stat().st_size
        self._shards.append(list(self._pending))
        self.total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def finish(self, extra_metadata: Mapping[str, object] | None = None) -> dict:
        """Write the last shard, rename shards to ``-of-N`` names, write the index; return the index."""
        self.flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"model-{i:05d}.safetensors", self.out_dir / final)
            for name in names:
                weight_map[name] = final
        index = {"metadata": {"total_size": self.total_bytes, **(extra_metadata or {})},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.out_dir / INDEX_NAME, index)
        return index

    @property
    def num_shards(self) -> int:
        return len(self._shards)


_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


def as_os_error(exc: BaseException, path: Path) -> BaseException:
    """A writer error as the ``OSError`` it wraps, so that ``atomic_output_dir`` turns a full disk into one line.

    ``safetensors.torch.save_file`` reports I/O failures as ``SafetensorError("Error while serializing: I/O
    error: No space left on device (os error 28)")``: its own type (not an ``OSError``) with the errno only in
    the text. An error whose text names an errno becomes ``OSError(errno, strerror, path)``; any other error
    of the writer becomes a ``CheckpointError`` naming the shard.
    """
    m = _OS_ERROR_RE.search(str(exc))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return CheckpointError(f"cannot write shard {path}: {type(exc).__name__}: {exc}")


def write_json(path: str | Path, obj, *, sort_keys: bool = False) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=sort_keys)
        f.write("\n")


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256, read in 16 MiB chunks (unbuffered: the reads go straight into the hash)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
