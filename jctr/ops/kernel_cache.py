"""numba's on-disk cache of jctr's kernels, invalidated by the modules their code comes from.

numba keys a cached kernel on the file that defines it and on nothing else: constants and
helpers it inlines from other modules are frozen into the cached machine code (numba's
documented limit). jctr's kernels inline across files: ``cpu_ffi`` takes the bucket width, the
empty key and the hash constants from ``hashing`` and the job records from ``cpu_parts``;
the stores' kernels take ``host_index``'s prefetch and copies. An edit to one of those alone
would leave kernels built from the old values running (a table probed with the wrong bucket
width reads as garbage, not as an error). The locators installed here give every cached
kernel defined in jctr a source stamp that also covers the jctr modules its file imports,
and theirs (read from the import statements), so such an edit compiles it again.

Example::

    from jctr.ops import kernel_cache
    kernel_cache.install()          # before the first ``cache=True`` kernel is made
    numba.njit(cache=True)(fn)      # its cache now follows the modules its file imports
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_installed: list = []  # the locator classes, once made
_packages: list[str] = []  # the packages whose kernels they cover


def covers(py_file: str, package: str = PACKAGE) -> bool:
    """Whether a kernel defined in ``py_file`` gets the wider stamp (a module of jctr)."""
    return os.path.abspath(py_file).startswith(package + os.sep)


def dependencies(py_file: str, package: str = PACKAGE) -> tuple[str, ...]:
    """``py_file`` and the modules of ``package`` it imports, and those they import (read
    from their import statements: names taken from a package's ``__init__`` count it, a
    submodule taken from a package does not), sorted."""
    roots = (os.path.dirname(package), package)  # "jctr.ops.x", or a top-level "x" inside
    seen: set[str] = set()
    todo = [os.path.abspath(py_file)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(p for p in _imported(path, roots, package) if p not in seen)
    return tuple(sorted(seen))


@functools.lru_cache(maxsize=256)
def _imported(path: str, roots: tuple[str, ...], package: str) -> tuple[str, ...]:
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found = [n for n in subs if _module_file(n, roots, package, True)]
            names.extend(found)
            if len(found) < len(subs):  # names defined in the package's __init__ itself
                names.append(node.module)
    return tuple(f for f in (_module_file(n, roots, package) for n in names) if f)


def _module_file(name: str, roots: tuple[str, ...], package: str,
                 plain_only: bool = False) -> str | None:
    parts = name.split(".")
    for root in roots:
        base = os.path.join(root, *parts)
        for path in (base + ".py",) if plain_only else (base + ".py",
                                                         os.path.join(base, "__init__.py")):
            if os.path.isfile(path) and covers(path, package):
                return os.path.abspath(path)
    return None


def sources_stamp(paths: tuple[str, ...]) -> bytes:
    """A digest of ``paths``' names and contents: it changes when any of them does."""
    listing = []
    for path in paths:
        st = os.stat(path)
        listing.append((path, st.st_mtime_ns, st.st_size))
    return _digest(tuple(listing))


@functools.lru_cache(maxsize=256)
def _digest(listing: tuple) -> bytes:
    # keyed on the files' times and sizes: an edit while the process runs is read again
    h = hashlib.sha256()
    for path, _, _ in listing:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.digest()


def install(package: str = PACKAGE) -> bool:
    """Put the locators in front of numba's own (once) and cover the kernels defined in
    ``package``; False where this numba has no such hook (its own locators then apply)."""
    if package not in _packages:
        _packages.append(package)
    if _installed:
        return True
    try:
        from numba.core import caching

        classes = caching.CacheImpl._locator_classes
        bases = [c for c in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                             caching.UserWideCacheLocator) if c in classes]
    except (ImportError, AttributeError):
        return False
    made = [type(f"Jctr{base.__name__}", (base,), {  # numba's order kept (NUMBA_CACHE_DIR first)
        "from_function": classmethod(_from_function), "get_source_stamp": _source_stamp})
        for base in bases]
    classes[:0] = made
    _installed.extend(made)
    return True


def _from_function(cls, py_func, py_file):
    package = next((p for p in _packages if covers(py_file, p)), None)
    if package is None:
        return None  # numba's own locators, after these
    self = super(cls, cls).from_function(py_func, py_file)
    if self is not None:
        self._jctr_package = package
    return self


def _source_stamp(self):
    own = super(type(self), self).get_source_stamp()
    return own, sources_stamp(dependencies(self._py_file, self._jctr_package))
