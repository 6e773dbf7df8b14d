"""numba's on-disk cache of jctr's kernels follows the modules their code is inlined from
(jctr/ops/kernel_cache.py)."""

import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

_RUN = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {pkg!r}]
    if {install}:
        from jctr.ops import kernel_cache
        assert kernel_cache.install(package={pkg!r})
    import kern
    print(kern.value(), len(kern.value.stats.cache_hits))
""")


def _run(pkg, install: bool) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _RUN.format(root=ROOT, pkg=str(pkg),
                                                           install=install)],
                         capture_output=True, text=True, timeout=120, cwd=str(pkg))
    assert out.returncode == 0, out.stderr
    value, hits = out.stdout.split()
    return int(value), int(hits)


def test_a_cached_kernel_is_built_again_when_a_module_it_inlines_from_changes(tmp_path):
    """numba keys a cached kernel on the file that defines it only ("Notes on caching" in
    numba's documentation: changes to other files are not detected), so a constant it
    imports from another module is frozen into the cached code: with numba's own locators a
    changed constant still reads the old value (the hazard of ``cpu_ffi``'s bucket width and
    empty key from ``hashing``). With jctr's locators installed the kernel is built again
    from the new value, and loaded from the cache while nothing changes."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "kern.py").write_text(textwrap.dedent("""
        import numba
        from consts import VALUE

        @numba.njit(cache=True)
        def value():
            return VALUE
    """))

    def constant(v):
        (pkg / "consts.py").write_text(f"VALUE = {v}\n")
        os.utime(pkg / "consts.py", ns=(v * 10**9, v * 10**9))  # a new stamp at any clock

    constant(1)
    assert _run(pkg, install=False) == (1, 0)
    constant(2)
    assert _run(pkg, install=False) == (1, 1)  # numba alone: the stale constant, from cache
    assert _run(pkg, install=True) == (2, 0)  # built again
    assert _run(pkg, install=True) == (2, 1)  # then loaded from the cache
    constant(3)
    assert _run(pkg, install=True) == (3, 0)


def test_the_locators_cover_jctrs_modules_only():
    """Functions outside jctr keep numba's own locators and stamps."""
    from jctr.ops import kernel_cache

    assert kernel_cache.install()
    pkg = kernel_cache.PACKAGE
    assert kernel_cache.covers(os.path.join(pkg, "ops", "cpu_ffi.py"))
    assert kernel_cache.covers(os.path.join(pkg, "stores", "sst_file.py"))
    assert not kernel_cache.covers(os.path.join(ROOT, "scripts", "bench_tables.py"))
    assert not kernel_cache.covers(pkg + "_other/x.py")
    from jctr.ops import cpu_ffi

    if cpu_ffi.AVAILABLE:
        locator = cpu_ffi._find_assign_handler._cache._impl._locator
        assert type(locator).__name__.startswith("Jctr")
        own, imported = locator.get_source_stamp()
        deps = kernel_cache.dependencies(cpu_ffi.__file__)
        assert imported == kernel_cache.sources_stamp(deps)
        names = {os.path.relpath(d, pkg) for d in deps}
        # what its kernels inline: constants, job records, prefetch; not the dispatch layer
        assert {"ops/cpu_ffi.py", "ops/hashing.py", "ops/cpu_parts.py",
                "ops/host_index.py"} <= names
        assert "ops/dispatch.py" not in names and "ops/__init__.py" not in names
