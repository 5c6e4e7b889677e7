"""All-or-nothing output folders.

``atomic_output_dir(out, overwrite)`` yields a temporary sibling ``.<name>.miles-lp-tmp-<pid>`` to write
into, and renames it to ``out`` only when the body finished without an exception. On any exception
(KeyboardInterrupt included) the temporary folder is removed. A run killed hard (SIGKILL, power loss) leaves
its temporary folder behind; the next run on the same ``out`` removes it (unless the process that made it is
still alive). With ``overwrite=True`` an existing ``out`` is replaced only after the new one is complete:
it is moved aside, the new folder is renamed in, then the old one is deleted. Before the rename, weight files
get the mode a plain file gets (``0o666 & ~umask``; safetensors creates them 0600).

Disk-full, permission and read-only errors become ``CheckpointError`` with a message that says where and
what to do; nothing half-written remains.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from miles_lp.errors import CheckpointError

TMP_TAG = ".miles-lp-tmp-"
OLD_TAG = ".miles-lp-old-"

_ENV_ERRNOS = {
    errno.ENOSPC: "no space left on the device; free space or choose another output folder",
    errno.EDQUOT: "disk quota exceeded; free space or choose another output folder",
    errno.EACCES: "permission denied; choose a folder you can write to or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you can write to or fix its permissions",
    errno.EROFS: "read-only file system; choose another output folder",
}


def tmp_name(out: Path, pid: int | None = None) -> Path:
    return out.parent / f".{out.name}{TMP_TAG}{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours, from an earlier (failed) attempt in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: Path, *, any_name: bool = False) -> list[Path]:
    """Remove temporary/old siblings of ``out`` left by killed runs (whose process is gone); ``any_name``: those
    of every name in ``out``'s folder (a run folder's checkpoints: a kill at step 40 left
    ``.step_000040...-tmp-PID``, which a resume from step 20 never writes again)."""
    removed = []
    if not out.parent.is_dir():
        return removed
    stem = "*" if any_name else out.name
    for tag in (TMP_TAG, OLD_TAG):
        for p in out.parent.glob(f".{stem}{tag}*"):
            pid_s = p.name.rsplit("-", 1)[-1]
            if pid_s.isdigit() and _pid_alive(int(pid_s)):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _free_space(folder: Path | None) -> str:
    """`` (N MB free in FOLDER)`` for a disk-full message; empty when it cannot be measured."""
    while folder is not None and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder is None:
        return ""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" ({free / 1e6:.1f} MB free in {folder})"


def env_error(exc: OSError, what: str, folder: Path | None = None) -> CheckpointError | None:
    """A ``CheckpointError`` for disk-full / permission errors, ``None`` for others.

    ``folder``: where the output goes; a disk-full message says how much space is free there.
    """
    hint = _ENV_ERRNOS.get(exc.errno)
    if hint is None and isinstance(exc, PermissionError):
        hint = _ENV_ERRNOS[errno.EACCES]
    if hint is None:
        return None
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    free = _free_space(folder) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return CheckpointError(f"cannot write {what}{where}: {exc.strerror or exc}{free}: {hint}. "
                           "Nothing was written.")


# ``--overwrite`` replaces an empty folder, one this project wrote (its records at the top), or an HF checkpoint
# whose every top-level entry is a checkpoint file (no subfolder): a mistyped ``--output ~`` or a project folder
# with a stray config.json is never deleted.
_OUR_RECORDS = ("miles_lp_plan.json", "miles_lp_tiny.json")  # names no other software writes
_CHECKPOINT_FILES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".md", ".jinja", ".py")


def _ours(out: Path) -> bool:
    """A folder this project wrote: a converted/exported checkpoint or tiny model (its record), a learner state
    (``state.json`` of that format + ``tensors.safetensors``) or a run checkpoint step (``loop.json`` + ``learner/``)."""
    if any((out / n).is_file() for n in _OUR_RECORDS):
        return True
    if (out / "loop.json").is_file() and (out / "learner").is_dir():
        return True
    if (out / "state.json").is_file() and (out / "tensors.safetensors").is_file():
        try:
            import json

            doc = json.loads((out / "state.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and set(doc) == {"version", "state"}
    return False


def _replaceable(out: Path) -> bool:
    try:
        entries = list(out.iterdir())
    except OSError:
        return False
    if not entries or _ours(out):
        return True
    has_weights = any(e.suffix == ".safetensors" for e in entries)
    return has_weights and (out / "config.json").is_file() and all(
        e.is_file() and (e.suffix in _CHECKPOINT_FILES or e.name.startswith("tokenizer")) for e in entries)


def check_output_target(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = (), *,
                        flag: str = "--output") -> Path:
    """Fail early (before any work) when ``out`` exists and ``overwrite`` is off, or is a file; when
    ``overwrite`` would replace a folder that is not a checkpoint; and when ``out`` is, contains or lies inside
    one of ``inputs`` (the replace at the end would delete the source). Returns ``out`` absolute. ``flag``: the
    calling command's option for ``out`` (``--output``; make-tiny-model's ``--out``), named in the messages."""
    out = Path(out).absolute()
    real = out.resolve()
    for src in inputs:
        src_real = Path(src).resolve()
        if real == src_real:
            raise CheckpointError(f"{flag} {out} is the input folder {src}: choose another output folder")
        if src_real.is_relative_to(real):
            raise CheckpointError(f"{flag} {out} contains the input {src}: replacing it would delete the input; "
                                  "choose an output folder outside the input's")
        if real.is_relative_to(src_real):
            raise CheckpointError(f"{flag} {out} lies inside the input folder {src}: choose an output folder "
                                  "outside it")
    blocker = blocking_file(out.parent)
    if blocker is not None:  # was a FileExistsError / NotADirectoryError traceback after the work
        raise CheckpointError(f"{flag} {out}: {blocker} is a file, not a folder; choose an output path whose parent "
                              "folders exist or can be created")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise CheckpointError(f"output {out} exists and is not a folder; choose another {flag}")
        if not overwrite:
            raise CheckpointError(f"output folder {out} already exists; pass --overwrite to replace it "
                                  "(it is replaced only after the new checkpoint is complete)")
        if not _replaceable(out):
            raise CheckpointError(f"output folder {out} is not empty and is not a checkpoint (no miles-lp record at "
                                  "its top, nor config.json + *.safetensors with checkpoint files only): --overwrite "
                                  f"replaces checkpoints only; choose another {flag} or remove the folder yourself")
    return out


def blocking_file(path: str | Path) -> Path | None:
    """The nearest existing component of ``path`` (itself, else its closest existing parent) when it is not a
    folder: the file that makes ``mkdir(parents=True)`` fail; ``None`` when nothing is in the way."""
    path = Path(path)
    near = next((p for p in (path, *path.parents) if p.exists()), None)
    return near if near is not None and not near.is_dir() else None


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False, inputs: tuple[str | Path, ...] = (), *,
                      flag: str = "--output") -> Iterator[Path]:
    out = check_output_target(out, overwrite, inputs, flag=flag)
    remove_stale_temps(out)
    tmp = tmp_name(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise env_error(exc, f"output folder {out}", out.parent) or CheckpointError(
            f"cannot create the output folder {out} ({exc.strerror or type(exc).__name__}"
            + (f": {exc.filename}" if getattr(exc, "filename", None) else "")
            + f"); choose another {flag}. Nothing was written.") from None
    try:
        yield tmp
        normal_file_modes(tmp)
        _commit(tmp, out, overwrite)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        err = env_error(exc, f"output folder {out}", out.parent)
        if err is None:
            raise
        raise err from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (``os.umask`` sets it, which for an
    instant would give files another thread creates mode 0666/0777)."""
    # no /proc (macOS) or an odd line: the portable way below, which sets the mask for an instant
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_file_modes(folder: Path, names: Iterable[str] | None = None) -> None:
    """Give the ``*.safetensors`` under ``folder`` (or only ``names`` in it) the mode a file ``open()`` creates,
    ``0o666 & ~umask``: safetensors' writer creates its files 0600 (a temporary file renamed), so a server under
    another uid could read config.json but not the weights beside it. Other files have that mode."""
    mode = 0o666 & ~current_umask()
    files = folder.rglob("*.safetensors") if names is None else (folder / n for n in names)
    for f in files:
        if f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) != mode:
            os.chmod(f, mode)


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:  # appeared while we were converting
            raise CheckpointError(f"output folder {out} appeared during the run; pass --overwrite to replace "
                                  "it. Nothing was written.")
        old = out.parent / f".{out.name}{OLD_TAG}{os.getpid()}"
        os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)  # put the previous checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
