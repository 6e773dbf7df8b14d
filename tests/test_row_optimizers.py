"""Row-wise optimizers against the dense (optax) optimizers of the same config."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jctr.config.schema import OptimizerConfig, SparseSGDRule
from jctr.embedding import row_optimizers as row_opt
from jctr.embedding.sparse_embedding import (
    EmbeddingSpec,
    apply_gradients,
    init_embedding,
    lookup_rows,
)
from jctr.train.dense_optimizer import dense_optimizer
from jctr.train.schedules import learning_rate_schedule

CAP, DIM = 40, 4
OPTS = [
    OptimizerConfig("SGD", learning_rate=0.1),
    OptimizerConfig("MomentumSGD", learning_rate=0.1, momentum_factor=0.9),
    OptimizerConfig("Nesterov", learning_rate=0.1, momentum_factor=0.9),
    OptimizerConfig("Adam", learning_rate=0.01, beta1=0.9, beta2=0.99, epsilon=1e-7),
    OptimizerConfig("AdaGrad", learning_rate=0.1, initial_accu_value=0.1, epsilon=1e-7),
]


def _run_rows(opt, values, steps):
    slots = row_opt.init_slots(opt, CAP, DIM)
    sched = learning_rate_schedule(opt)
    for t, (rows, g) in enumerate(steps):
        values, slots = row_opt.apply_rows(opt, values, slots, jnp.asarray(rows),
                                           jnp.asarray(g), sched(jnp.int32(t)),
                                           jnp.int32(t + 1))
    return np.asarray(values)


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.type)
def test_local_rows_equal_dense_optimizer_on_those_rows(opt):
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=(CAP, DIM)).astype(np.float32))
    rows = np.array([3, 17, 5, 39])
    steps = [(rows, rng.normal(size=(4, DIM)).astype(np.float32)) for _ in range(4)]
    got = _run_rows(opt, values, steps)
    tx = dense_optimizer(opt)
    p = values[rows]
    state = tx.init(p)
    for _, g in steps:
        upd, state = tx.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, upd)
    np.testing.assert_allclose(got[rows], np.asarray(p), rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(CAP), rows)
    np.testing.assert_array_equal(got[untouched], np.asarray(values)[untouched])


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.type)
def test_global_equals_dense_optimizer_on_the_whole_table(opt):
    opt = OptimizerConfig(**{**opt.__dict__, "update_type": "Global"})
    rng = np.random.default_rng(1)
    values = jnp.asarray(rng.normal(size=(CAP, DIM)).astype(np.float32))
    steps = [(rng.choice(CAP, 5, replace=False), rng.normal(size=(5, DIM)).astype(np.float32))
             for _ in range(4)]
    got = _run_rows(opt, values, steps)
    tx = dense_optimizer(opt)
    p = values
    state = tx.init(p)
    for rows, g in steps:
        dense = jnp.zeros((CAP, DIM), jnp.float32).at[rows].add(g)
        upd, state = tx.update(dense, state, p)
        p = optax.apply_updates(p, upd)
    np.testing.assert_allclose(got, np.asarray(p), rtol=1e-5, atol=1e-6)


def test_local_and_global_differ_for_adam_on_untouched_rows():
    rng = np.random.default_rng(2)
    values = jnp.asarray(rng.normal(size=(CAP, DIM)).astype(np.float32))
    steps = [(np.array([1, 2]), np.ones((2, DIM), np.float32)),
             (np.array([3]), np.ones((1, DIM), np.float32))]
    local = _run_rows(OPTS[3], values, steps)
    glob = _run_rows(OptimizerConfig(**{**OPTS[3].__dict__, "update_type": "Global"}),
                     values, steps)
    assert not np.allclose(local[1], glob[1])  # Global keeps moving row 1 at step 2
    np.testing.assert_allclose(local[3], glob[3], rtol=1e-6)


def _hugectr_adagrad(w, accum, g, lr, eps):
    """One step of HugeCTR's AdaGrad in float32, element by element: ``accum += g * g;
    w -= lr * g / (sqrt(accum) + eps)`` (``opt_adagrad_kernel`` in
    HugeCTR/src/optimizers/sparse_optimizer.cu for embedding rows, ``ada_grad_update_kernel``
    in HugeCTR/src/optimizers/adagrad_optimizer.cu for the dense weights)."""
    f = np.float32
    accum = (accum + g * g).astype(f)
    return (w - (f(lr) * g).astype(f) / (np.sqrt(accum) + f(eps))).astype(f), accum


def _hugectr_adam(w, m, v, g, t, lr, b1, b2, eps):
    """Step ``t`` of HugeCTR's Adam in float32: ``m = b1 * m + (1 - b1) * g``, ``v = b2 * v
    + (1 - b2) * g * g``, ``w -= alpha_t * m / (sqrt(v) + eps)`` with ``alpha_t = lr *
    sqrt(1 - b2 ** t) / (1 - b1 ** t)`` (``opt_adam_kernel`` in
    HugeCTR/src/optimizers/sparse_optimizer.cu for embedding rows, ``adam_update`` in
    adam_optimizer.cu for the dense weights; ``alpha_t`` on the host in double)."""
    f = np.float32
    m = (f(b1) * m + f(1 - b1) * g).astype(f)
    v = (f(b2) * v + f(1 - b2) * g * g).astype(f)
    alpha = f(lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t))
    return (w - (alpha * m).astype(f) / (np.sqrt(v) + f(eps))).astype(f), m, v


HUGECTR_RULES = {  # the config, HugeCTR's step in float32, its state before the first step
    "Adam": (OptimizerConfig("Adam", learning_rate=0.001, beta1=0.9, beta2=0.999,
                             epsilon=1e-7),
             lambda w, st, g, t: _hugectr_adam(w, *st, g, t, 0.001, 0.9, 0.999, 1e-7), 2),
    "AdaGrad": (OptimizerConfig("AdaGrad", learning_rate=0.05, initial_accu_value=0.0,
                                epsilon=1e-7),
                lambda w, st, g, t: _hugectr_adagrad(w, *st, g, 0.05, 1e-7), 1),
}


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e-6])
@pytest.mark.parametrize("rule", ["Adam", "AdaGrad"])
def test_adam_and_adagrad_are_hugectrs_epsilon_beside_the_root(rule, scale):
    """Adam's and AdaGrad's rows and dense weights take HugeCTR's steps, ``alpha_t * m /
    (sqrt(v) + eps)`` with the bias corrections in ``alpha_t`` and ``lr * g / (sqrt(accum) +
    eps)``, not optax's ``m_hat / (sqrt(v_hat) + eps)`` and ``g / sqrt(accum + eps)``: for
    the small gradients of rare keys (``scale`` 1e-4, 1e-6) optax's Adam steps several times
    further early in training (HugeCTR's epsilon weighs 32 times more at step 1), its AdaGrad
    a third, or a thousandth, as far. The dense state keeps optax's types, so that a
    checkpoint of either form loads as the other."""
    opt, hugectr, states = HUGECTR_RULES[rule]
    rng = np.random.default_rng(4)
    values = rng.normal(size=(CAP, DIM)).astype(np.float32)
    rows = np.array([3, 17, 5, 39])
    steps = [(rows, (scale * rng.normal(size=(4, DIM))).astype(np.float32))
             for _ in range(3)]
    w, state = values[rows], (np.zeros((4, DIM), np.float32),) * states
    for t, (_, g) in enumerate(steps, 1):
        w, *state = hugectr(w, state, g, t)
    got = _run_rows(opt, jnp.asarray(values), steps)
    np.testing.assert_allclose(got[rows], w, rtol=1e-6, atol=1e-7)
    tx = dense_optimizer(opt)
    p = jnp.asarray(values[rows])
    dense_state = tx.init(p)
    for _, g in steps:
        upd, dense_state = tx.update(jnp.asarray(g), dense_state, p)
        p = optax.apply_updates(p, upd)
    np.testing.assert_allclose(np.asarray(p), w, rtol=1e-6, atol=1e-7)
    assert isinstance(dense_state[0], optax.ScaleByAdamState if rule == "Adam"
                      else optax.ScaleByRssState)


@pytest.mark.parametrize("rule", ["Adam", "AdaGrad"])
def test_dense_state_of_hugectrs_formulas_is_optaxs(rule):
    """A checkpoint written with optax's Adam / AdaGrad (jctr before HugeCTR's formulas) holds
    the same state tree, leaf for leaf, as HugeCTR's formulas make: it restores and trains on
    (the moments and the accumulator mean the same; only the step computed from them
    changed)."""
    import jax

    opt = HUGECTR_RULES[rule][0]
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros((4,))}
    for clause in (opt, OptimizerConfig(**{**opt.__dict__, "warmup_steps": 10})):
        lr = learning_rate_schedule(clause)
        old = (optax.adam(lr, b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon) if rule == "Adam"
               else optax.adagrad(lr, initial_accumulator_value=opt.initial_accu_value,
                                  eps=opt.epsilon)).init(params)
        new = dense_optimizer(clause).init(params)
        assert jax.tree.structure(old) == jax.tree.structure(new)
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
            assert a.shape == b.shape and a.dtype == b.dtype


def test_lazy_global_applies_missed_decay():
    opt = OptimizerConfig("Adam", update_type="LazyGlobal", learning_rate=0.01, beta1=0.9,
                          beta2=0.99)
    values = jnp.zeros((CAP, DIM), jnp.float32)
    slots = row_opt.init_slots(opt, CAP, DIM)
    g = jnp.ones((1, DIM), jnp.float32)
    rows = jnp.array([7])
    values, slots = row_opt.apply_rows(opt, values, slots, rows, g, jnp.float32(0.01),
                                       jnp.int32(1))
    # row 7 skips steps 2..4, then is touched at step 5: moments decay by beta^3 first
    values, slots = row_opt.apply_rows(opt, values, slots, rows, g, jnp.float32(0.01),
                                       jnp.int32(5))
    m1 = 0.1
    m5 = 0.9 * (m1 * 0.9 ** 3) + 0.1
    np.testing.assert_allclose(np.asarray(slots["m"][7]), m5, rtol=1e-5)
    assert int(slots["last_step"][7]) == 5


@pytest.mark.parametrize("first", [1, 2**31 - 2, 2**32 - 2, 5 * 2**32 + 7])
def test_lazy_global_counts_missed_steps_across_the_32_bit_wrap(first):
    """A row's ``last_step`` is int32 (4 bytes a row) while the run's count is 64-bit: past
    2**31 iterations the stored count wraps, and ``count - 1 - last_step`` read billions of
    missed steps, zeroing the moments of every row touched again
    (``row_optimizers.apply_rows``). The gap is taken modulo 2**32: a row skipped three
    steps decays by beta**3 at any count."""
    opt = OptimizerConfig("Adam", update_type="LazyGlobal", learning_rate=0.01, beta1=0.9,
                          beta2=0.99)
    slots = row_opt.init_slots(opt, CAP, DIM)
    values, g = jnp.zeros((CAP, DIM), jnp.float32), jnp.ones((1, DIM), jnp.float32)
    rows = jnp.array([7])
    m, v = 0.1, 0.01
    for count in (first, first + 4, first + 8):
        values, slots = row_opt.apply_rows(opt, values, slots, rows, g, jnp.float32(0.01),
                                           jnp.asarray(count, jnp.int64))
        if count > first:
            m, v = 0.9 * m * 0.9 ** 3 + 0.1, 0.99 * v * 0.99 ** 3 + 0.01
        np.testing.assert_allclose(np.asarray(slots["m"][7]), m, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(slots["v"][7]), v, rtol=1e-5)


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.type)
def test_duplicate_keys_sum_their_gradients(opt):
    spec = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=3, max_features=6,
                         one_hot=False, input_index=0, optimizer=opt)
    state = init_embedding(spec)
    keys = jnp.array([11, 22, 11, 11, 33, 22], jnp.int64)
    segs = jnp.array([0, 1, 2, 3, 4, 6], jnp.int32)  # last key is padding (6 = 2 * 3)
    state, lk = lookup_rows(spec, state, keys, segs, 2, train=True)
    # the gradient w.r.t. the pooled [2, 3, dim] embeddings; sum combiner: every key of a
    # segment gets that segment's gradient
    grad_pooled = jnp.arange(6 * DIM, dtype=jnp.float32).reshape(2, 3, DIM) / 10
    grads = grad_pooled.reshape(6, DIM)[jnp.minimum(segs, 5)]
    new = apply_gradients(spec, state, lk, segs, grad_pooled, jnp.float32(opt.learning_rate),
                          jnp.int32(1))
    rows = np.asarray(lk.rows)
    # reference: dense optimizer on the 3 distinct rows with summed gradients
    g = np.asarray(grads)
    summed = np.stack([g[[0, 2, 3]].sum(0), g[1], g[4]])
    tx = dense_optimizer(opt)
    p = state.values[rows[[0, 1, 4]]]
    upd, _ = tx.update(jnp.asarray(summed), tx.init(p), p)
    want = optax.apply_updates(p, upd)
    np.testing.assert_allclose(np.asarray(new.values)[rows[[0, 1, 4]]], np.asarray(want),
                               rtol=1e-5, atol=1e-6)
    assert rows[5] == -1


def test_schedule_warmup_and_decay():
    opt = OptimizerConfig("SGD", learning_rate=2.0, warmup_steps=10, decay_start=20,
                          decay_steps=10, decay_power=2.0, end_lr=0.5)
    s = learning_rate_schedule(opt)
    lr = [float(s(jnp.int32(c))) for c in range(35)]
    assert lr[0] == pytest.approx(0.2) and lr[9] == pytest.approx(2.0)
    assert lr[15] == pytest.approx(2.0)
    t = 25  # update number 25 -> count 24
    assert lr[t - 1] == pytest.approx((2.0 - 0.5) * ((30 - t) / 10) ** 2 + 0.5)
    assert lr[34] == pytest.approx(0.5)
    assert s(jnp.int32(3)).dtype == jnp.float32


@pytest.mark.parametrize("opt", OPTS + [OptimizerConfig("Adam", update_type="Global",
                                                        learning_rate=0.01)],
                         ids=lambda o: f"{o.type}-{o.update_type}")
def test_embedding_regularization_touches_each_batch_row_once(opt):
    """l2/l1: the gradient of each row the batch touches gains l2 * w + l1 * sign(w), once per
    row however often its key occurs; other rows are not regularized."""
    l2, l1 = 0.5, 0.1
    spec = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=2, max_features=2, one_hot=True,
                         input_index=0, optimizer=opt, seed=3)
    reg = EmbeddingSpec(**{**spec.__dict__, "l2": l2, "l1": l1})
    # 2 samples x 2 slots: key 7 twice, key 9 once, one padding position
    keys = jnp.asarray([7, 9, 7, 0], jnp.int64)
    segs = jnp.asarray([0, 1, 2, 4], jnp.int32)  # 4 = batch * slot_num: padding
    grad = jnp.asarray(np.random.default_rng(2).normal(size=(2, 2, DIM)).astype(np.float32))
    state, lk = lookup_rows(reg, init_embedding(reg), keys, segs, 2, train=True)
    got = apply_gradients(reg, state, lk, segs, grad, jnp.float32(opt.learning_rate),
                          jnp.int32(1))
    # the hand-computed update: summed key gradients plus the penalty, through the plain rule
    rows = np.asarray(lk.rows[:2])
    w = np.asarray(state.values)[rows]
    g = np.stack([grad[0, 0] + grad[1, 0], grad[0, 1]]) + l2 * w + l1 * np.sign(w)
    want, _ = row_opt.apply_rows(opt, state.values, state.slots, jnp.asarray(rows),
                                 jnp.asarray(g), jnp.float32(opt.learning_rate), jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want), rtol=1e-6, atol=1e-7)
    plain = apply_gradients(spec, *lookup_rows(spec, init_embedding(spec), keys, segs, 2,
                                               train=True), segs, grad,
                            jnp.float32(opt.learning_rate), jnp.int32(1))
    assert not np.allclose(np.asarray(plain.values)[rows], np.asarray(got.values)[rows])


def test_every_row_l2_equals_a_dense_penalty_over_many_steps():
    """Issue 37 point 1: ``l2_rows: "all"`` regularizes the whole table as FuxiCTR's
    ``embedding_regularizer`` does (fuxictr/pytorch/models/rank_model.py,
    ``regularization_loss``: ``(lambda / p) * ||E||_p^p`` added to the loss, so an L2 penalty
    of ``lambda / 2 * ||E||^2`` whose gradient is ``lambda * E`` for every row). Against dense
    SGD on that loss for 60 steps of a 30-row table, each step's batch touching a few rows
    (duplicates summed): every row, touched or not, equals the reference; ``touched`` leaves
    untouched rows alone."""
    lr, l2 = 0.05, 0.3
    opt = OptimizerConfig("SGD", learning_rate=lr)
    base = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=1, max_features=1, one_hot=True,
                         input_index=0, optimizer=opt, seed=5, l2=l2)
    every = EmbeddingSpec(**{**base.__dict__, "l2_all": True})
    keys = jnp.arange(30, dtype=jnp.int64) * 7919 + 3
    rng = np.random.default_rng(4)
    for spec in (every, base):
        state, lk = lookup_rows(spec, init_embedding(spec), keys,
                                jnp.arange(30, dtype=jnp.int32), 30, train=True)
        rows = np.asarray(lk.rows)
        w = np.asarray(state.values)[rows].astype(np.float64)  # the dense reference
        for t in range(60):
            pick = rng.integers(0, 30, 6)  # a batch of 6 one-hot samples, keys may repeat
            grad = rng.normal(size=(6, 1, DIM)).astype(np.float32)
            state, lk = lookup_rows(spec, state, keys[pick], jnp.arange(6, dtype=jnp.int32), 6,
                                    train=True)
            state = apply_gradients(spec, state, lk, jnp.arange(6, dtype=jnp.int32),
                                    jnp.asarray(grad), jnp.float32(lr), jnp.int32(t + 1))
            g = np.zeros_like(w)
            np.add.at(g, pick, grad[:, 0].astype(np.float64))
            hit = np.zeros(30, bool)
            hit[pick] = True
            if spec.l2_all:
                w = w * (1 - lr * l2) - lr * g
            else:  # the penalty on the batch's rows only, once per row
                w = w - lr * (g + l2 * w * hit[:, None])
        np.testing.assert_allclose(np.asarray(state.values)[rows], w, rtol=2e-5, atol=1e-6)


def _paddle_sparse_adagrad(w, g2sum, g, show, embed, embedx):
    """PaddlePaddle's SparseAdaGradSGDRule for one row, in float64 loops (the reference)."""
    w, g2sum = w.astype(np.float64).copy(), g2sum.astype(np.float64).copy()
    for part, (rule, cols) in enumerate(((embed, [0]), (embedx, list(range(1, w.size))))):
        ratio = rule.learning_rate * np.sqrt(rule.initial_g2sum
                                             / (rule.initial_g2sum + g2sum[part]))
        add = 0.0
        for c in cols:
            scaled = g[c] / show
            w[c] = min(max(w[c] - ratio * scaled, rule.weight_bounds[0]),
                       rule.weight_bounds[1])
            add += scaled * scaled
        g2sum[part] += add / len(cols)
    return w, g2sum


def test_sparse_adagrad_sgd_rule_against_a_hand_computed_row():
    """The first dimension and the rest follow their own rules; a key's summed gradient is
    divided by its occurrences in the batch; weights are clipped to weight_bounds; a new row
    starts within each part's initial_range."""
    from jctr.config.parser import parse_config
    from jctr.config.schema import SparseSGDRule

    embed = SparseSGDRule(learning_rate=0.05, initial_g2sum=3.0, initial_range=1e-4,
                          weight_bounds=(-10.0, 10.0))
    embedx = SparseSGDRule(learning_rate=0.5, initial_g2sum=1.0, initial_range=0.02,
                           weight_bounds=(-0.03, 0.03))
    opt = OptimizerConfig("SparseAdaGradSGDRule", learning_rate=1.0, embed_sgd_param=embed,
                          embedx_sgd_param=embedx)
    spec = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=2, max_features=2, one_hot=True,
                         input_index=0, optimizer=opt, seed=5)
    keys = jnp.asarray([7, 9, 7, 0], jnp.int64)  # key 7 twice, key 9 once, one padding
    segs = jnp.asarray([0, 1, 2, 4], jnp.int32)
    state, lk = lookup_rows(spec, init_embedding(spec), keys, segs, 2, train=True)
    rows = np.asarray(lk.rows[:2])
    w0 = np.asarray(state.values)[rows]
    assert (np.abs(w0[:, 0]) <= 1e-4).all() and (np.abs(w0[:, 1:]) <= 0.02).all()
    assert np.abs(w0[:, 1:]).max() > 1e-4  # the embedx range, not the embed one
    g2 = np.zeros((2, 2))
    w = w0.copy()
    rng = np.random.default_rng(0)
    for step in range(3):
        grad = jnp.asarray(rng.normal(size=(2, 2, DIM)).astype(np.float32) * 0.3)
        state = apply_gradients(spec, state, lk, segs, grad, jnp.float32(1.0),
                                jnp.int32(step + 1))
        g_rows = [np.asarray(grad[0, 0] + grad[1, 0]), np.asarray(grad[0, 1])]
        for i, (gr, show) in enumerate(zip(g_rows, (2, 1))):
            w[i], g2[i] = _paddle_sparse_adagrad(w[i], g2[i], gr, show, embed, embedx)
    np.testing.assert_allclose(np.asarray(state.values)[rows], w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.slots["g2sum"])[rows], g2, rtol=1e-5)
    assert np.abs(w[:, 1:]).max() == pytest.approx(0.03)  # the embedx bound was reached
    # the config: an embedding's own clause, with Paddle's defaults where keys are left out
    layers = [{"name": "data", "type": "Data", "source": "x", "eval_source": "x",
               "label": {"top": "label", "label_dim": 1},
               "dense": {"top": "dense", "dense_dim": 1},
               "sparse": [{"top": "s", "type": "DistributedSlot", "slot_num": 1,
                           "max_feature_num_per_sample": 1}]},
              {"name": "e", "type": "DistributedSlotSparseEmbeddingHash", "bottom": "s",
               "top": "e", "sparse_embedding_hparam": {"max_vocabulary_size_per_gpu": 10,
                                                       "embedding_vec_size": 4},
               "optimizer": {"type": "SparseAdaGradSGDRule",
                             "embedx_sgd_param": {"learning_rate": 0.5,
                                                  "weight_bounds": [-0.03, 0.03]}}},
              {"name": "r", "type": "Reshape", "bottom": "e", "top": "r", "leading_dim": 4},
              {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
               "fc_param": {"num_output": 1}},
              {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc", "label"],
               "top": "loss"}]
    cfg = parse_config({"solver": {}, "optimizer": {"type": "Adam"}, "layers": layers})
    parsed = cfg.embedding_optimizer(cfg.embeddings[0])
    assert parsed.embed_sgd_param == SparseSGDRule()
    assert parsed.embedx_sgd_param == SparseSGDRule(learning_rate=0.5,
                                                    weight_bounds=(-0.03, 0.03))
    from jctr.config import ConfigError

    with pytest.raises(ConfigError, match="optimizer.type.*embedding rows only"):
        parse_config({"solver": {}, "optimizer": {"type": "SparseAdaGradSGDRule"},
                      "layers": layers})
    bad = [dict(layers[1], optimizer={"type": "SparseAdaGradSGDRule",
                                      "embed_sgd_param": {"weight_bounds": [1, -1]}})]
    with pytest.raises(ConfigError, match="embed_sgd_param.weight_bounds.*low < high"):
        parse_config({"solver": {}, "optimizer": {"type": "Adam"},
                      "layers": layers[:1] + bad + layers[2:]})


def test_sparse_adagrad_divides_by_the_pushed_shows_of_a_show_column():
    """Paddle's ``CtrCommonAccessor::Update`` (ctr_accessor.cc) passes ``push_show`` (the sum
    of the key's shows in the push) to ``SparseAdaGradSGDRule::UpdateValue``
    (sparse_sgd_rule.cc), which divides the summed gradient by it: with the optimizer's
    ``show`` column (streaming's ``show_click_entry``), key 7 in two samples of shows 2.0 and
    3.0 is divided by 5, not by its 2 occurrences; a key pushed with 0 shows is not divided.
    The whole train step does the same on one device and sharded over 8 (same rows)."""
    import dataclasses

    from jctr.embedding.engine import segment_shows

    opt = OptimizerConfig("SparseAdaGradSGDRule", learning_rate=1.0, show="dense[1]")
    spec = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=2, max_features=2, one_hot=True,
                         input_index=0, optimizer=opt, seed=5)
    keys = jnp.asarray([7, 9, 7, 11], jnp.int64)  # key 7 in samples 0 and 1
    segs = jnp.asarray([0, 1, 2, 3], jnp.int32)
    dense = jnp.asarray([[0.0, 2.0], [0.0, 3.0]], jnp.float32)  # shows: 2 and 3
    label = jnp.zeros((2, 1), jnp.float32)
    dense0 = dense.at[1, 1].set(0.0)  # sample 1 shown 0 times
    for d, shows_of in ((dense, {7: 5.0, 9: 2.0, 11: 3.0}), (dense0, {7: 2.0, 9: 2.0,
                                                                       11: 1.0})):
        state, lk = lookup_rows(spec, init_embedding(spec), keys, segs, 2, train=True)
        rows = {k: int(lk.rows[i]) for i, k in enumerate([7, 9, 7, 11]) if i != 2}
        w0 = np.asarray(state.values)
        grad = jnp.asarray(np.random.default_rng(1).normal(size=(2, 2, DIM)), jnp.float32)
        shows = segment_shows(label, d, spec)[segs]
        new = apply_gradients(spec, state, lk, segs, grad, jnp.float32(1.0), jnp.int32(1),
                              shows=shows)
        g = {7: np.asarray(grad[0, 0] + grad[1, 0]), 9: np.asarray(grad[0, 1]),
             11: np.asarray(grad[1, 1])}
        for k, r in rows.items():
            want, _ = _paddle_sparse_adagrad(w0[r], np.zeros(2), g[k], shows_of[k],
                                             opt.embed_sgd_param or SparseSGDRule(),
                                             opt.embedx_sgd_param or SparseSGDRule())
            np.testing.assert_allclose(np.asarray(new.values)[r], want, rtol=1e-5, atol=1e-7)
    # without the column: occurrences, as before
    plain = dataclasses.replace(spec, optimizer=dataclasses.replace(opt, show=None))
    state, lk = lookup_rows(plain, init_embedding(plain), keys, segs, 2, train=True)
    r7 = int(lk.rows[0])
    new = apply_gradients(plain, state, lk, segs, grad, jnp.float32(1.0), jnp.int32(1))
    want, _ = _paddle_sparse_adagrad(np.asarray(state.values)[r7], np.zeros(2), g[7], 2,
                                     SparseSGDRule(), SparseSGDRule())
    np.testing.assert_allclose(np.asarray(new.values)[r7], want, rtol=1e-5, atol=1e-7)


def test_admission_gives_embedx_once_the_score_reaches_the_threshold():
    """embedx_threshold 0.25 with Paddle's score (click + 0.1 * (show - click)): key 7 shown
    three times (0.3) and key 9 clicked once (1.0) get their embedx dimensions' initial values
    after the step that counted them (that step trains their first dimension only); key 11
    shown once (0.1), then twice (0.2), keeps zeros there and its embedx never trains."""
    from jctr.embedding.sparse_embedding import initial_vectors

    opt = OptimizerConfig("SparseAdaGradSGDRule", learning_rate=1.0, embedx_threshold=0.25)
    spec = EmbeddingSpec("e", capacity=CAP, dim=DIM, slot_num=1, max_features=1, one_hot=True,
                         input_index=0, optimizer=opt, seed=2)
    keys = jnp.asarray([7, 7, 9, 7, 11], jnp.int64)
    segs = jnp.arange(5, dtype=jnp.int32)
    clicks = jnp.asarray([0, 0, 1, 0, 0], jnp.float32)
    state, lk = lookup_rows(spec, init_embedding(spec), keys, segs, 5, train=True)
    rows = np.asarray(lk.rows)[[0, 2, 4]]  # keys 7, 9, 11
    assert (np.asarray(state.values)[rows, 1:] == 0).all()  # the first dimension only
    grad = jnp.ones((5, 1, DIM), jnp.float32)
    state = apply_gradients(spec, state, lk, segs, grad, jnp.float32(1.0), jnp.int32(1),
                            keys, clicks)
    values = np.asarray(state.values)
    init = np.asarray(initial_vectors(spec, jnp.asarray([7, 9, 11], jnp.int64)))
    np.testing.assert_array_equal(values[rows[:2], 1:], init[:2, 1:])
    assert (values[rows[2], 1:] == 0).all()
    assert (values[rows, 0] != init[:, 0]).all()  # the first dimension trained
    acc = np.asarray(state.slots["accessor"])[rows]
    np.testing.assert_allclose(acc, [[3, 0, 1], [1, 1, 1], [1, 0, 0]])
    # a second step: key 7's embedx trains now; key 11 (score 0.2) still waits
    state, lk = lookup_rows(spec, state, keys[3:], segs[:2], 2, train=True)
    state = apply_gradients(spec, state, lk, segs[:2], grad[:2], jnp.float32(1.0),
                            jnp.int32(2), keys[3:], clicks[3:])
    values = np.asarray(state.values)
    assert (values[rows[0], 1:] < init[0, 1:]).all()
    assert (values[rows[2], 1:] == 0).all()
    np.testing.assert_allclose(np.asarray(state.slots["accessor"])[rows[2]], [2, 0, 0])


CHUNKED = OPTS[1:] + [
    OptimizerConfig("Adam", update_type="LazyGlobal", learning_rate=0.01),
    OptimizerConfig("SparseAdaGradSGDRule", learning_rate=1.0),
]


@pytest.mark.parametrize("opt", CHUNKED, ids=lambda o: f"{o.type}-{o.update_type}")
def test_rows_stepped_in_chunks_equal_one_pass(opt, monkeypatch):
    """A batch of millions of keys steps its rows in chunks (row_optimizers.row_chunk) to
    bound the step's temporaries; the result is the one-pass update, padding rows dropped."""
    rng = np.random.default_rng(5)
    values = jnp.asarray(rng.normal(size=(CAP, DIM)).astype(np.float32))
    # distinct rows, some out of range (padding / non-representative keys: dropped)
    rows = np.concatenate([rng.permutation(CAP)[:23], [CAP] * 4])
    steps = [(rng.permutation(rows), rng.normal(size=(27, DIM)).astype(np.float32))
             for _ in range(3)]
    occ = jnp.asarray(rng.integers(1, 4, 27).astype(np.float32))

    def run():
        v, slots = values, row_opt.init_slots(opt, CAP, DIM)
        for t, (r, g) in enumerate(steps):
            v, slots = row_opt.apply_rows(opt, v, slots, jnp.asarray(r), jnp.asarray(g),
                                          jnp.float32(0.05), jnp.int32(t + 1), l2=0.01,
                                          occurrences=occ)
        return np.asarray(v), {k: np.asarray(x) for k, x in slots.items()}

    whole = run()
    monkeypatch.setattr(row_opt, "row_chunk", lambda dim: 5)  # 27 rows: 6 chunks, padded
    chunked = run()
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6, atol=1e-7)
    for k in whole[1]:
        np.testing.assert_allclose(chunked[1][k], whole[1][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", OPTS[1:], ids=lambda o: o.type)
def test_global_update_in_blocks_equals_one_pass(opt, monkeypatch):
    """``Global`` steps the whole table in blocks of row_chunk rows (in place): the same
    values and state as one pass, including a last, shorter block."""
    opt = OptimizerConfig(**{**opt.__dict__, "update_type": "Global"})
    rng = np.random.default_rng(6)
    values = jnp.asarray(rng.normal(size=(CAP, DIM)).astype(np.float32))
    steps = [(rng.permutation(CAP)[:9], rng.normal(size=(9, DIM)).astype(np.float32))
             for _ in range(3)]

    def run():
        v, slots = values, row_opt.init_slots(opt, CAP, DIM)
        for t, (r, g) in enumerate(steps):
            v, slots = row_opt.apply_rows(opt, v, slots, jnp.asarray(r), jnp.asarray(g),
                                          jnp.float32(0.05), jnp.int32(t + 1))
        return np.asarray(v), {k: np.asarray(x) for k, x in slots.items()}

    whole = run()
    monkeypatch.setattr(row_opt, "row_chunk", lambda dim: 7)  # 40 rows: 5 blocks + 5 rows
    blocks = run()
    np.testing.assert_allclose(blocks[0], whole[0], rtol=1e-6, atol=1e-7)
    for k in whole[1]:
        np.testing.assert_allclose(blocks[1][k], whole[1][k], rtol=1e-6, atol=1e-7)
