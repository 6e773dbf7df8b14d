"""Where data commands may write: only into a new or empty folder, never over a file they did
not create, unless the user passes ``--force``.

Example::

    require_empty_folder(args.output, force=args.force)   # before converting into it
"""

from __future__ import annotations

import os

from jctr.data.records import DataError


def folder_contents(folder: str) -> list[str]:
    """The entries of ``folder`` (none if it does not exist)."""
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def describe_contents(entries: list[str]) -> str:
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    return f"{len(entries)} entries ({shown})"


def require_empty_folder(folder: str, *, force: bool = False) -> None:
    """Raise :class:`DataError` unless ``folder`` is new or empty (or ``force``)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise DataError(f"{folder}: exists and is not a folder")
    entries = folder_contents(folder)
    if entries and not force:
        raise DataError(f"{folder}: holds {describe_contents(entries)}; jctr writes only into "
                        "a new or empty folder (--force writes into it anyway, replacing files "
                        "of the same names)")


def require_absent(paths: list[str], *, force: bool = False) -> None:
    """Raise :class:`DataError` if one of ``paths`` exists (unless ``force``)."""
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not force:
        raise DataError(f"{existing[0]}: exists ({len(existing)} of the {len(paths)} files to "
                        "write do); --force overwrites them")
