import copy
import json
import os
import shutil
import tempfile

import pytest

_LEVEL_FLAG = "--xla_backend_optimization_level"


def _compile_level() -> str:
    """The suite's XLA flag for LLVM's optimization level on CPU: ``-O0``. Tests compile
    hundreds of small programs and run each for a few steps: compiling was two thirds of a
    sharding test's time, and at -O0 they compile in about half of it (the steps run slower,
    but they are tiny). Results stay IEEE arithmetic: the tests compare implementations
    compiled alike, with tolerances. None where XLA_FLAGS set a level already (the user's, or
    this run's in a pytest-xdist worker), on a GPU machine (its kernels are the point there),
    or with ``JCTR_TEST_XLA_LEVEL=default``."""
    import importlib.metadata
    import re

    if _LEVEL_FLAG in os.environ.get("XLA_FLAGS", "") or \
            os.environ.get("JCTR_TEST_XLA_LEVEL") == "default":
        return ""
    if any(re.match(r"jax[-_.](cuda|rocm)", d.metadata["Name"] or "", re.I)
           for d in importlib.metadata.distributions()):
        return ""
    return f"{_LEVEL_FLAG}=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process a test starts: ``devices`` CPU devices and this run's
    optimization level, if XLA_FLAGS set one."""
    level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(_LEVEL_FLAG)]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *level[-1:]])


# Multi-device tests run on 8 forced CPU devices; single-device code uses the first one.
# Must be set before JAX starts (importing jctr imports it).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_compile_level()}".strip()

# One XLA compilation cache for the whole run, shared with the subprocesses tests start: dozens
# of tests compile the same small models (suite time; numerics are those of the same compiled
# code). A fresh folder per run, removed at the end: nothing outlives the run.
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="jctr-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jctr._x64  # noqa: E402,F401  (64-bit keys on before tests touch JAX)

if jctr._x64.jax.default_backend() == "gpu":  # scripts/gpu_check.sh
    # float32 references with float32 tolerances: no TF32 (HugeCTR's enable_tf32_compute is
    # off by default, and the trainer's steps follow it)
    jctr._x64.jax.config.update("jax_default_matmul_precision", "float32")

# tests of the native CPU kernels themselves (jctr.ops.cpu_ffi): on a GPU machine the default
# backend runs the Pallas kernels and XLA formulations instead
native_cpu_only = pytest.mark.skipif(jctr._x64.jax.default_backend() != "cpu",
                                     reason="native CPU kernel (jctr.ops.cpu_ffi)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def load_json(name: str) -> dict:
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
        return json.load(f)


def mappings_under(folder) -> list[str]:
    """This process's memory mappings of files under ``folder`` (``/proc/self/maps`` lines;
    a file that has no name ends in "(deleted)")."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(folder) in line]


def tiny_config(tmp_path, model: str = "dlrm", **solver) -> dict:
    """A shipped *_synthetic config with its data redirected under tmp_path."""
    cfg = copy.deepcopy(load_json(f"{model}_synthetic.json"))
    data = cfg["layers"][0]
    data["source"] = str(tmp_path / model / "train" / "_file_list.txt")
    data["eval_source"] = str(tmp_path / model / "eval" / "_file_list.txt")
    cfg["solver"].update(solver)
    return cfg


@pytest.fixture
def tiny(tmp_path):
    return lambda model="dlrm", **solver: tiny_config(tmp_path, model, **solver)


def pytest_sessionfinish(session, exitstatus):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
