"""One run owns a folder: a ``LOCK`` file naming its process (pid, host, start, run id).

A second run that finds a live owner is refused with who owns it; a lock whose process is gone
(same host) is reported and taken over. The core trainer's snapshot folder
(:class:`jctr.checkpoint.manager.Checkpointer`) and streaming training's ``save_model_path``
are locked this way.

Example::

    lock = FolderLock("runs/online", hint="choose another save_model_path")
    lock.acquire(report=print)      # raises FolderInUse if a live run holds it
    ...
    lock.release()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable

from jctr.errors import UserError

LOCK = "LOCK"


class FolderInUse(UserError, RuntimeError):
    """Another live run holds the folder; the message names it and the owner."""


class FolderLock:
    """The ``LOCK`` file of ``folder`` (see the module docstring). ``hint`` ends the message
    of a refusal (what the user can do besides waiting)."""

    def __init__(self, folder: str, *, run_id: str | None = None, hint: str = "",
                 error: type[Exception] = FolderInUse):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LOCK)
        self.run_id = run_id or uuid.uuid4().hex
        self.hint = hint
        self.error = error
        self.held = False

    def owner(self) -> dict | None:
        """The LOCK file's record, or None when the folder is not locked."""
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError):
            return {"pid": None, "host": None, "started": None}

    def check_free(self) -> None:
        """Raise if another live run holds the folder (a stale lock does not count)."""
        owner = self.owner()
        if owner is None or owner.get("run") == self.run_id or is_stale(owner):
            return
        raise self.error(f"{self.folder}: in use by another run ({describe_owner(owner)}); "
                         f"wait for it to end{', ' + self.hint if self.hint else ''}, or "
                         f"remove {self.path} if that run is gone")

    def acquire(self, report: Callable[[str], None] = print) -> None:
        """Create the folder and take the lock (refused while a live run holds it)."""
        if self.held:
            return
        os.makedirs(self.folder, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "run": self.run_id}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.owner()
                if owner is None:
                    continue
                if not is_stale(owner):
                    self.check_free()
                report(f"[jctr] {self.folder}: the run that locked it "
                       f"({describe_owner(owner)}) is gone; taking over its lock")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            except OSError as e:
                raise self.error(f"{self.path}: cannot write: {e.strerror}") from e
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
            break
        else:
            raise self.error(f"{self.path}: could not take the lock (another run keeps "
                             "taking it)")
        self.held = True
        atexit.register(self.release)

    def release(self) -> None:
        """Give the folder up (the lock file is removed if it is still ours)."""
        if not self.held:
            return
        self.held = False
        owner = self.owner()
        if owner is not None and owner.get("run") == self.run_id:
            with contextlib.suppress(OSError):
                os.remove(self.path)


def is_stale(owner: dict) -> bool:
    """A lock whose process is gone (same host only: another host's processes are unknown)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def describe_owner(owner: dict) -> str:
    started = owner.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float)) else "an unknown time")
    return f"pid {owner.get('pid')} on host {owner.get('host')}, since {when}"
