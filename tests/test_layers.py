"""Every layer against a hand-written numpy formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jctr.models import layers as L
from jctr.ops import dot_interaction, dot_interaction_reference, embedding_bag

B = 6
rng = np.random.default_rng(0)


def ctx(train=False, mask=None):
    m = np.ones(B, np.float32) if mask is None else mask
    return L.Context(train, jax.random.PRNGKey(0), jnp.asarray(m))


def x2(n=5):
    return rng.normal(size=(B, n)).astype(np.float32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), b, rtol=tol, atol=tol)


def test_inner_product_and_fused():
    x = x2(7)
    for relu in (False, True):
        m = L.InnerProduct(7, 3, relu=relu, rngs=nnx.Rngs(0))
        w, b = np.asarray(m.kernel[...]), np.asarray(m.bias[...])
        want = x @ w + b
        close(m([jnp.asarray(x)], ctx())[0], np.maximum(want, 0) if relu else want)


def test_relu_elu():
    x = x2()
    close(L.ReLU()([x], ctx())[0], np.maximum(x, 0))
    close(L.ELU(0.7)([x], ctx())[0], np.where(x > 0, x, 0.7 * (np.exp(x) - 1)))


def test_dropout_train_and_eval():
    x = np.ones((B, 1000), np.float32)
    d = L.Dropout(0.25, 0)
    close(d([x], ctx(False))[0], x)
    y = np.asarray(d([x], ctx(True))[0])
    kept = y != 0
    assert 0.7 < kept.mean() < 0.8
    close(y[kept], np.full(kept.sum(), 1 / 0.75))


def test_batchnorm_train_masked_and_eval():
    x = x2(4)
    mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
    bn = L.BatchNorm(4, factor=0.5, eps=1e-5)
    y = np.asarray(bn([x], ctx(True, mask))[0])
    real = x[:4]
    mean, var = real.mean(0), real.var(0)
    close(y[:4], (real - mean) / np.sqrt(var + 1e-5), 1e-4)
    close(bn.mean[...], 0.5 * mean)
    close(bn.var[...], 0.5 * 1.0 + 0.5 * var)
    y_eval = bn([x], ctx(False))[0]
    close(y_eval, (x - 0.5 * mean) / np.sqrt(0.5 + 0.5 * var + 1e-5), 1e-4)


def test_reshape_concat_slice_split_add():
    e = rng.normal(size=(B, 3, 4)).astype(np.float32)
    close(L.Reshape((12,))([e], ctx())[0], e.reshape(B, 12))
    a, b = x2(2), x2(3)
    close(L.Concat()([a, b], ctx())[0], np.concatenate([a, b], 1))
    close(L.Concat()([e, e], ctx())[0], np.concatenate([e, e], 1))
    x = x2(6)
    s1, s2 = L.Slice([(0, 4), (2, 6)])([x], ctx())
    close(s1, x[:, 0:4])
    close(s2, x[:, 2:6])
    outs = L.Split(3)([x], ctx())
    assert len(outs) == 3
    close(outs[2], x)
    close(L.Elementwise()([a, a, a], ctx())[0], 3 * a)
    close(L.Elementwise(product=True)([a, 2 * a, a], ctx())[0], 2 * a ** 3)


def test_multiply():
    x = x2(3)
    m = L.Multiply(3, 4, rngs=nnx.Rngs(1))
    w = np.asarray(m.weight[...])
    close(m([x], ctx())[0], (x[:, :, None] * w[None]).reshape(B, 12))


def test_fm_order2():
    v = rng.normal(size=(B, 5, 3)).astype(np.float32)
    want = 0.5 * (v.sum(1) ** 2 - (v ** 2).sum(1))
    # brute force: sum over pairs i < j of v_i * v_j
    brute = sum(v[:, i] * v[:, j] for i in range(5) for j in range(i + 1, 5))
    close(want, brute, 1e-4)
    close(L.FmOrder2(3)([v.reshape(B, 15)], ctx())[0], want, 1e-4)


def test_multicross():
    x0 = x2(5)
    m = L.MultiCross(5, 3, rngs=nnx.Rngs(2))
    w, b = np.asarray(m.w[...]), np.asarray(m.b[...])
    x = x0
    for i in range(3):
        x = x0 * (x @ w[i])[:, None] + b[i] + x
    close(m([x0], ctx())[0], x, 1e-4)


@pytest.mark.parametrize("axis", [1, 2])
def test_reduce_sum(axis):
    e = rng.normal(size=(B, 3, 4)).astype(np.float32)
    close(L.ReduceSum(axis)([e], ctx())[0], e.sum(axis, keepdims=True))


def test_interaction():
    d = x2(4)
    e = rng.normal(size=(B, 3, 4)).astype(np.float32)
    out = np.asarray(L.Interaction()([d, e], ctx())[0])
    feats = np.concatenate([d[:, None], e], 1)
    dots = [np.sum(feats[:, i] * feats[:, j], -1) for i in range(4) for j in range(i)]
    want = np.concatenate([d, np.stack(dots, 1), np.zeros((B, 1))], 1)
    assert out.shape == (B, 4 + 6 + 1)
    close(out, want, 1e-4)
    close(dot_interaction(jnp.asarray(d), jnp.asarray(e)), want, 1e-4)
    close(dot_interaction_reference(jnp.asarray(d), jnp.asarray(e)), want, 1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_interaction_gradient_matches_reference(dtype):
    d = jnp.asarray(x2(8), dtype)
    e = jnp.asarray(rng.normal(size=(B, 5, 8)), dtype)
    w = jnp.asarray(rng.normal(size=(B, 8 + 15 + 1)), dtype)

    def loss(fn):
        return lambda d, e: jnp.sum((fn(d, e) * w).astype(jnp.float32))

    got = jax.grad(loss(dot_interaction), argnums=(0, 1))(d, e)
    want = jax.grad(loss(dot_interaction_reference), argnums=(0, 1))(d, e)
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=tol, atol=tol * 10)


def test_embedding_bag_sum_mean_and_empty():
    vecs = rng.normal(size=(7, 3)).astype(np.float32)
    seg = np.array([0, 0, 1, 3, 3, 3, 5], np.int32)  # 2 and 4 empty, 5 dropped (num_segments 5)
    s = np.asarray(embedding_bag(vecs, seg, 5, "sum"))
    m = np.asarray(embedding_bag(vecs, seg, 5, "mean"))
    close(s[0], vecs[0] + vecs[1])
    close(s[3], vecs[3:6].sum(0))
    close(m[3], vecs[3:6].mean(0))
    close(s[2], np.zeros(3))
    close(m[4], np.zeros(3))


def _bce(z, y):
    p = 1 / (1 + np.exp(-z))
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def test_losses():
    mask = np.array([1, 1, 1, 1, 1, 0], np.float32)
    z = x2(1)
    y = (rng.random((B, 1)) > 0.5).astype(np.float32)
    loss, pred = L.BinaryCrossEntropyLoss()([z, y], ctx(mask=mask))
    close(loss, _bce(z[:5, 0], y[:5, 0]).mean(), 1e-5)
    close(pred, 1 / (1 + np.exp(-z[:, 0])))
    z2 = x2(2)
    loss, pred = L.CrossEntropyLoss()([z2, y], ctx(mask=mask))
    logp = z2 - np.log(np.exp(z2).sum(1, keepdims=True))
    close(loss, -logp[np.arange(5), y[:5, 0].astype(int)].mean(), 1e-5)
    close(pred, np.exp(logp[:, 1]), 1e-5)
    z3, y3 = x2(3), (rng.random((B, 3)) > 0.5).astype(np.float32)
    w = np.array([1.0, 2.0, 0.5])
    loss, _ = L.MultiCrossEntropyLoss(w)([z3, y3], ctx(mask=mask))
    close(loss, ((_bce(z3, y3) * w).sum(1) / w.sum())[:5].mean(), 1e-5)


def test_regularizers():
    from jctr.config.parser import parse_dense_layer
    from jctr.config.reader import ObjectReader
    from jctr.models.graph import GraphNetwork

    layers = [
        {"name": "fc1", "type": "InnerProduct", "bottom": "dense", "top": "fc1",
         "fc_param": {"num_output": 1}},
        {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc1", "label"],
         "top": "loss", "regularizer": "L2", "lambda": 0.1},
    ]
    cfgs = [parse_dense_layer(ObjectReader(d, f"layers[{i}]"), d["type"])
            for i, d in enumerate(layers)]
    for reg in ("L1", "L2"):
        net = GraphNetwork(cfgs, {"dense": (4,), "label": (1,)}, regularizer=reg,
                           reg_lambda=0.1, rngs=nnx.Rngs(0))
        x, y = x2(4), np.ones((B, 1), np.float32)
        loss, _ = net({"dense": x, "label": y}, ctx())
        w = np.asarray(net.layers[0].kernel[...])
        z = x @ w + np.asarray(net.layers[0].bias[...])
        term = 0.5 * (w ** 2).sum() if reg == "L2" else np.abs(w).sum()
        close(loss, _bce(z[:, 0], 1.0).mean() + 0.1 * term / B, 1e-5)


def test_every_config_layer_type_has_one_module():
    from jctr.config.layer_types import LAYER_TYPES

    assert set(L.MODULES) == set(LAYER_TYPES)
    with pytest.raises(TypeError, match="Gelu is not declared"):
        L.layer_type("Gelu")(type("Gelu", (L.Layer,), {}))


def test_interaction_over_the_embeddings_alone():
    emb = np.random.default_rng(0).normal(size=(3, 4, 16)).astype(np.float32)
    ctx = L.Context(train=False, rng=None, mask=jnp.ones(3))
    (out,) = L.Interaction(dense_input=False)([jnp.asarray(emb)], ctx)
    want = [[emb[b, i] @ emb[b, j] for i in range(4) for j in range(i)] + [0.0]
            for b in range(3)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
