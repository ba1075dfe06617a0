"""Where autopar writes: output paths checked before any solving, files
written atomically, and nothing overwritten that autopar did not write.

A compile takes minutes; an ``-o`` naming a directory, a path under a file
or a read-only place must be reported before it, not after. A write goes to
a temporary file in the same directory and is renamed over the target
(``os.replace``), so a full disk or a killed process leaves the old file or
the new one, never half of either.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

from autopar.errors import OutputError


def check_file(path: str, what: str, is_ours, ours: str = "an autopar plan (no \"schema\": "
               "\"autopar.plan/...\" in it)") -> None:
    """``path`` can be written as a file: not a directory, its folder not a
    file, writable; an existing file only if ``is_ours(text)`` says autopar
    wrote it (``ours`` says what that is)."""
    if os.path.isdir(path):
        raise OutputError(f"{what} {path!r} is a directory; name a file in it instead, e.g. "
                          f"{os.path.join(path, 'plan.json')!r}")
    _check_folder(os.path.dirname(os.path.abspath(path)), what, path)
    if os.path.exists(path) and not is_ours(_read(path)):
        raise OutputError(f"{what} {path!r} exists and is not {ours}; autopar will not overwrite it: name "
                          "another file, or move that one away first")


MANIFEST = ".autopar-written"
"""The files autopar wrote into an output directory: a sha256 and a name per line."""


def record_written(path: str, names) -> None:
    """Note in ``path``'s manifest that autopar wrote ``names`` there, as they are now."""
    lines = [f"{_sha256(os.path.join(path, n))}  {n}\n" for n in sorted(set(names))]
    write_text(os.path.join(path, MANIFEST), "".join(lines))


def _written_here(path: str) -> set:
    """The files in ``path`` that autopar wrote and nobody changed since (its
    manifest), with the manifest itself and Python's ``__pycache__``."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            entries = [line.rstrip("\n").split("  ", 1) for line in f if "  " in line]
    except OSError:
        return set()
    return {name for digest, name in entries if _sha256(os.path.join(path, name)) == digest} | {
        MANIFEST, "__pycache__"}


def _sha256(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return ""


def check_dir(path: str, what: str, force: bool = False) -> None:
    """``path`` can be written as a directory: not a file, writable, and
    holding nothing autopar did not write there unless ``force``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{what} {path!r} is a file, not a directory; name a directory")
    if os.path.isdir(path):
        _check_folder(path, what, path)
        entries = sorted(set(os.listdir(path)) - _written_here(path))
        if entries and not force:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise OutputError(f"{what} {path!r} is not empty ({shown}); autopar will not write into it: name a "
                              "new or empty directory, or pass --force to replace the files it writes there")
    else:
        _check_folder(os.path.dirname(os.path.abspath(path)), what, path)


def is_plan(text: str) -> bool:
    """Whether ``text`` (a file's beginning) is plan JSON autopar wrote."""
    try:
        obj = json.loads(text)
    except ValueError:
        return '"schema": "autopar.plan/' in text
    return isinstance(obj, dict) and str(obj.get("schema", "")).startswith("autopar.plan/")


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file, then a rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"cannot write {path!r}: {e.strerror} ({folder!r}); choose another output path") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise OutputError(f"cannot write {path!r}: {e.strerror}; the file is left as it was. Free space or "
                          "choose another output path") from None


def _check_folder(folder: str, what: str, path: str) -> None:
    """The folder ``path`` goes in: the nearest existing ancestor must be a
    directory in which a file can be created (a read-only filesystem or
    missing permissions fail here)."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OutputError(f"{what} {path!r} goes under {existing!r}, which is a file, not a directory; "
                          "choose another output path")
    try:
        fd, tmp = tempfile.mkstemp(dir=existing, prefix=".autopar-probe.")
    except OSError as e:
        raise OutputError(f"{what} {path!r} cannot be written: {existing!r} refuses new files ({e.strerror}); "
                          "choose a writable output path") from None
    os.close(fd)
    os.unlink(tmp)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
