"""The fully connected op with a row-major backward, and the bf16 formulations XLA:CPU's
YNNPACK kernels take (``jctr.ops.linear``, ``jctr.ops.interaction.pair_dots_gram``)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import cpu_ffi, dot_interaction, dot_interaction_reference, every_platform, linear
from jctr.ops.interaction import pair_dots_gram
from jctr.ops.linear import linear_reference, linear_rowmajor
from jctr.runtime.xla_options import step_compiler_options

rng = np.random.default_rng(3)
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _grads(fn, x, w, b, relu, probe, options=None):
    def loss(x, w, b):
        return jnp.sum(fn(x, w, b, relu).astype(jnp.float32) * probe)

    argnums = (0, 1) if b is None else (0, 1, 2)
    f = jax.jit(jax.value_and_grad(loss, argnums=argnums), compiler_options=options or {})
    return f(x, w, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 13, 512), (96, 367, 32), (40, 256, 1), (8, 16, 16)])
@pytest.mark.parametrize("relu,bias", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("options", [None, NO_YNN], ids=["default", "no_ynn"])
def test_linear_rowmajor_matches_reference(dtype, shape, relu, bias, options):
    m, k, n = shape
    # each case its own draw: the module's generator gave a case whatever the tests run
    # before it in its process left (pytest-xdist spreads them differently run to run)
    rng = np.random.default_rng([m, k, n, relu, bias, dtype == jnp.bfloat16])
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.normal(size=(n,)), dtype) if bias else None
    probe = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    (got_v, got_g) = _grads(linear_rowmajor, x, w, b, relu, probe, options)
    (want_v, want_g) = _grads(linear_reference, x.astype(jnp.float32), w.astype(jnp.float32),
                              None if b is None else b.astype(jnp.float32), relu, probe)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    # the loss sums m * n rounded terms: their errors add up like the terms' root sum of
    # squares, however close to 0 the sum itself is
    terms = linear_reference(x.astype(jnp.float32), w.astype(jnp.float32),
                             None if b is None else b.astype(jnp.float32), relu) * probe
    scale = float(jnp.abs(want_v)) + float(jnp.sqrt(jnp.sum(terms * terms))) + 1.0
    assert abs(float(got_v) - float(want_v)) <= tol * scale
    for g, r in zip(got_g, want_g):
        assert g.dtype == dtype
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=tol,
                                   atol=tol * (np.abs(r).max() + 1e-6))


def test_linear_dispatch_keeps_float32_plain_and_dtype():
    x, w, b = jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.full((2,), -4.0)
    np.testing.assert_array_equal(linear(x, w, b, relu=True), np.zeros((4, 2)))
    np.testing.assert_array_equal(linear(x, w, b), np.full((4, 2), -1.0))
    y = linear(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), None)
    assert y.dtype == jnp.bfloat16 and np.asarray(y, np.float32).tolist() == [[3.0, 3.0]] * 4


def test_pair_dots_gram_matches_reference():
    d = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(24, 6, 8)), jnp.float32)
    feats = jnp.concatenate([d[:, None], e], axis=1)
    want = dot_interaction_reference(d, e)[:, 8:-1]
    np.testing.assert_allclose(pair_dots_gram(feats), want, rtol=1e-5, atol=1e-5)
    w = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
    g = jax.grad(lambda f: jnp.sum(pair_dots_gram(f) * w))(feats)
    f = feats.shape[1]
    li, lj = np.tril_indices(f, k=-1)

    def ref(fe):
        gram = jnp.einsum("bfd,bgd->bfg", fe, fe)
        return jnp.sum(gram[:, li, lj] * w)

    np.testing.assert_allclose(g, jax.grad(ref)(feats), rtol=1e-4, atol=1e-4)


def _has_ynn() -> bool:
    a = jnp.ones((64, 64), jnp.bfloat16)
    text = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32)).lower(
        a).compile().as_text()
    return "__ynn_fusion" in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU kernel selection")
def test_bfloat16_mlp_and_interaction_matmuls_all_reach_ynnpack():
    """The point of the row-major formulations: in a bf16 DLRM-like forward + backward no
    matmul is left to XLA's float32 fallback (operands converted, ~2x slower)."""
    if not _has_ynn():
        pytest.skip("this jaxlib's XLA:CPU has no YNNPACK fusions")
    assert step_compiler_options("bfloat16") == {}
    bf = jnp.bfloat16
    dense = jnp.asarray(rng.normal(size=(128, 13)), bf)
    emb = jnp.asarray(rng.normal(size=(128, 5, 16)), bf)
    ws = [jnp.asarray(rng.normal(size=s) * 0.1, bf) for s in [(13, 64), (64, 16),
                                                               (16 + 15 + 1, 64), (64, 1)]]
    bs = [jnp.zeros((w.shape[1],), bf) for w in ws]

    def loss(ws, bs, emb):
        z = linear(linear(dense, ws[0], bs[0], relu=True), ws[1], bs[1], relu=True)
        x = dot_interaction(z, emb)
        y = linear(linear(x, ws[2], bs[2], relu=True), ws[3], bs[3])
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(ws, bs, emb).compile().as_text()
    entry = text.split("\nENTRY")[1]
    # (matrix-vector products, the width-1 layer's, may stay with XLA: a few flops)
    plain_dots = [d for d in re.findall(r"= \S+\[([0-9,]+)\]\S* dot\(", entry)
                  if "1" not in d.split(",")]
    fused_dots = [line for line in entry.splitlines()
                  if "__ynn_fusion" in line and ("dot_general" in line or "->" in line)]
    # three layers x (forward, d input, d kernel) - 1 (no d input for the data); XLA turns the
    # width-1 layer's products into reductions. The interaction's forward and backward are
    # the native kernels (jctr.ops.cpu_ffi) or, without them, two more YNNPACK fusions.
    native = cpu_ffi.AVAILABLE
    assert len(fused_dots) >= 3 * 3 - 1 + (0 if native else 2), entry
    assert ("jctr_cpu_pair_dots_grad" in entry) == native
    assert not plain_dots, plain_dots


def test_bfloat16_linear_lowers_to_plain_dots_for_cuda():
    """On GPU (cuBLAS takes transposed operands) the bf16 layer keeps the plain formulation:
    its backward lowered for ``cuda`` has no materialised transposes (optimization barriers)."""
    bf = jnp.bfloat16
    x, w, b = jnp.ones((32, 16), bf), jnp.ones((16, 8), bf), jnp.zeros((8,), bf)

    def loss(x, w, b):
        return jnp.sum(linear(x, w, b, relu=True).astype(jnp.float32))

    with every_platform():
        cuda = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, w, b).lower(
            lowering_platforms=("cuda",)).as_text()
        cpu = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, w, b).lower(
            lowering_platforms=("cpu",)).as_text()
    assert "optimization_barrier" not in cuda and "dot_general" in cuda
    assert "optimization_barrier" in cpu
