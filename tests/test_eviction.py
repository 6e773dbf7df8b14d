"""Eviction (issue 36 point 2): a full table gives new keys the rows of the keys its policy
ranks lowest, inside the training step.

The reference is a dictionary model of the same rule, written from its description in
jctr/embedding/hash_table.py (``_evict``): each new key samples rows by its hash, takes the
lowest-ranked one not touched in the step, the first position wins a contested row and the
others sample again (four rounds). NVIDIA HierarchicalKV's policies (``lru``, ``lfu``,
``epoch_lru``, ``epoch_lfu``) define the ranks; HugeCTR refuses a full table
(``TableFullError``), which stays the default.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jctr._x64  # noqa: F401
from jctr.config.schema import EvictionConfig
from jctr.embedding.hash_table import create_table, erase, export_items, lookup
from jctr.ops.hashing import mix64

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Model:
    """The table as a dictionary: key -> row, and each row's (last step, touches)."""

    def __init__(self, capacity: int, ev: EvictionConfig):
        self.c, self.ev = capacity, ev
        self.rows: dict[int, int] = {}
        self.last = np.zeros(capacity, np.int64)
        self.count = np.zeros(capacity, np.int64)
        self.free: list[int] = []
        self.size = self.clock = self.evicted = self.overflow = 0

    def rank(self, r: int) -> int:
        last, ev = int(self.last[r]), self.ev
        if last == self.clock:
            return np.iinfo(np.int64).max
        epoch = last // ev.epoch_steps
        return {"lru": last, "lfu": (int(self.count[r]) << 32) | last,
                "epoch_lru": (epoch << 32) | last,
                "epoch_lfu": (epoch << 32) | int(self.count[r])}[ev.policy]

    def step(self, keys: list[int]) -> None:
        """One training lookup of distinct ``keys``."""
        self.clock += 1
        restart = set()
        for k in keys:  # found keys: epoch_lfu counts again in a new epoch
            r = self.rows.get(k)
            if r is not None and self.ev.policy == "epoch_lfu" and (
                    self.last[r] // self.ev.epoch_steps != self.clock // self.ev.epoch_steps):
                restart.add(r)
        new = [k for k in keys if k not in self.rows]
        needy = []
        for k in new:  # free rows first (the top of the stack), then rows never handed out
            if self.free:
                r = self.free.pop()
            elif self.size < self.c:
                r, self.size = self.size, self.size + 1
            else:
                needy.append(k)
                continue
            self.rows[k] = r
            restart.add(r)
        for k in keys:
            if k in self.rows:
                self.last[self.rows[k]] = self.clock
        by_row = {r: k for k, r in self.rows.items()}
        s = self.ev.samples
        for rnd in range(4):
            choice = {}
            for j, k in enumerate(needy):
                h = mix64(np.array([k], np.int64).view(np.uint64))[0]
                salts = (np.arange(s, dtype=np.uint64) + np.uint64(rnd * s + 1)) * GOLDEN
                cand = (mix64(h ^ salts) % np.uint64(self.c)).astype(np.int64)
                ranks = [self.rank(int(r)) for r in cand]
                best = int(np.argmin(ranks))
                if ranks[best] < np.iinfo(np.int64).max:
                    choice.setdefault(int(cand[best]), j)  # the first position wins
            won = set()
            for r, j in choice.items():
                k = needy[j]
                del self.rows[by_row[r]]
                self.rows[k] = by_row[r] = r
                self.last[r] = self.clock
                restart.add(r)
                won.add(j)
                self.evicted += 1
            needy = [k for j, k in enumerate(needy) if j not in won]
        self.overflow += len(needy)
        for r in restart:
            self.count[r] = 0
        for k in keys:
            if k in self.rows:
                self.count[self.rows[k]] += 1


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lru", "epoch_lfu"])
def test_eviction_equals_a_dictionary_model(policy, kernels, monkeypatch):
    """80 steps of 12 distinct keys (a hot set of 10 keys and a stream of cold ones) through
    a table of 24 rows: every step the table's key -> row map, its eviction and overflow
    counts and every row's scores equal the model's; under lru and lfu most hot keys stay.
    An erase midway frees rows that new keys take before any eviction. ``auto`` on CPU runs
    the native kernels (``jctr_cpu_find_assign``, ``jctr_cpu_evict``), ``reference`` the XLA
    formulations: both make the model's choices."""
    monkeypatch.setenv("JCTR_KERNELS", kernels)
    capacity = 24
    ev = EvictionConfig(policy, epoch_steps=5, samples=4)
    model = Model(capacity, ev)
    table = create_table(capacity, ev)
    step = jax.jit(lambda t, k: lookup(t, k, jnp.ones(k.shape, bool), capacity, insert=True,
                                       eviction=ev))
    drop = jax.jit(lambda t, k: erase(t, k, jnp.ones(k.shape, bool)))
    rng = np.random.default_rng(1)
    for i in range(80):
        hot = rng.choice(10, 4, replace=False)
        cold = rng.choice(np.arange(10, 400), 8, replace=False)
        keys = np.concatenate([hot, cold]).astype(np.int64)
        rng.shuffle(keys)
        table, lk = step(table, jnp.asarray(keys))
        model.step(keys.tolist())
        got_keys, got_rows = export_items(table)
        assert dict(zip(got_keys.tolist(), got_rows.tolist())) == model.rows, i
        rows = np.asarray(lk.rows)
        for k, r in zip(keys.tolist(), rows.tolist()):
            assert model.rows.get(k, -1) == r
        assert int(table.evicted) == model.evicted and int(table.overflow) == model.overflow
        score = np.asarray(table.row_score)
        np.testing.assert_array_equal(score[:, 0], model.last, err_msg=f"step {i}")
        if ev.score_columns > 1:
            np.testing.assert_array_equal(score[:, 1], model.count, err_msg=f"step {i}")
        if i == 40:  # erase three held keys: their rows go first to the next new keys
            gone = np.array(sorted(model.rows)[:3], np.int64)
            table, freed = drop(table, jnp.asarray(gone))
            for k in gone.tolist():
                model.free.append(model.rows.pop(k))
            assert sorted(np.asarray(freed).tolist()) == sorted(model.free)
    assert model.evicted > 200 and model.overflow == 0
    if policy in ("lru", "lfu"):  # the hot keys stay far more than the cold ones
        held_hot = sum(k in model.rows for k in range(10)) / 10
        assert held_hot >= 0.6 > 4 * (len(model.rows) - 10 * held_hot) / 390


def test_a_table_without_eviction_keeps_refusing_when_full():
    """No eviction object: HugeCTR's behaviour, unchanged (overflow counted, row -1)."""
    table = create_table(4)
    assert table.row_slots.shape == (0,) and table.row_score.shape == (0, 1)
    keys = jnp.arange(6, dtype=jnp.int64)
    table, lk = lookup(table, keys, jnp.ones(6, bool), 4, insert=True)
    assert np.asarray(lk.rows).tolist()[4:] == [-1, -1] and int(table.overflow) == 2


def _evicting(tmp_path, policy="lru", capacity=60, **solver):
    from tests.conftest import tiny_config

    base = dict(max_iter=30, display=1, eval_interval=10, eval_batches=2,
                snapshot_prefix=str(tmp_path / "run_"))
    base.update(solver)
    cfg = tiny_config(tmp_path, "dlrm", **base)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = capacity
    cfg["layers"][1]["optimizer"] = {"type": "Adam", "update_type": "Local",
                                     "adam_hparam": {"learning_rate": 0.01}}
    cfg["layers"][1]["eviction"] = {"policy": policy}
    return cfg


def test_a_full_table_trains_on_by_evicting_and_resumes_exactly(tmp_path):
    """A DLRM whose table holds 60 rows of a few hundred keys (Adam rows: state that an
    evicted key's successor must not inherit): training goes on where it would stop with
    TableFullError; evictions are logged with each evaluation and in TensorBoard's tables;
    a checkpoint at iteration 13 resumes to the same losses and counts of evicted and refused
    keys as the run that went through (the scores and the table's clock come back with the
    rows, the counts with the snapshot's metadata)."""
    from jctr.config import parse_config
    from jctr.embedding.sparse_embedding import EmbeddingSpec, init_embedding
    from jctr.train.trainer import Trainer

    lines = []
    full = Trainer(parse_config(_evicting(tmp_path)), log=lines.append)
    full.fit()
    evals = [x for x in lines if x.startswith("[jctr] eval at iter")]
    assert evals and " evicted" in evals[-1]
    evicted = int(np.asarray(full.state.embeddings[0].table.evicted))
    # new keys take rows in order of first occurrence, so hot keys (early in a batch) hold
    # rows and are evicted less than when the last occurrence ranked them
    assert evicted > 40
    reference = {h["iter"]: h["loss"] for h in full.history if h["kind"] == "train"}
    norms = [h for h in full.history if h["kind"] == "eval"][-1]["embedding_norms"]
    assert norms["sparse_embedding1"]["evicted"] == evicted
    assert norms["sparse_embedding1"]["rows"] == 60

    Trainer(parse_config(_evicting(tmp_path, max_iter=13, snapshot=13)),
            log=lambda s: None).fit()
    resumed = Trainer(parse_config(_evicting(tmp_path)), log=lambda s: None)
    assert resumed.restore_checkpoint() == 13
    table = resumed.state.embeddings[0].table
    assert int(table.clock) == 13
    resumed.fit()
    got = {h["iter"]: h["loss"] for h in resumed.history if h["kind"] == "train"}
    assert sorted(got) == list(range(14, 31))
    for it, loss in got.items():
        assert loss == reference[it], (it, loss, reference[it])
    # the keys evicted and refused count on from the snapshot's (the log's figures)
    for name in ("evicted", "overflow"):
        assert (int(np.asarray(getattr(resumed.state.embeddings[0].table, name)))
                == int(np.asarray(getattr(full.state.embeddings[0].table, name)))), name

    # an evicted key's row starts as in a new table: its vector and Adam's moments
    cfg = parse_config(_evicting(tmp_path))
    spec = EmbeddingSpec.from_config(cfg, cfg.embeddings[0])
    assert spec.eviction.policy == "lru" and int(init_embedding(spec).table.clock) == 0


def test_eviction_on_eight_devices(tmp_path):
    """The table spread over 8 host devices by key hash (each device's part evicts on its
    own): training goes on past the capacity, each part full and evicting."""
    from jctr.config import parse_config
    from jctr.train.trainer import Trainer

    cfg = _evicting(tmp_path, capacity=16, max_iter=12, eval_interval=100)
    cfg["solver"]["gpu"] = list(range(8))
    cfg["layers"][1]["sparse_embedding_hparam"]["replicated"] = False
    t = Trainer(parse_config(cfg), log=lambda s: None)
    t.fit()
    table = t.state.embeddings[0].table
    assert np.asarray(table.size).tolist() == [16] * 8
    assert all(e > 0 for e in np.asarray(table.evicted).tolist())


def test_a_checkpoint_resumes_with_eviction_switched_on_or_off(tmp_path):
    """Eviction is a table option a resumed run may change: a checkpoint without scores
    restores into an evicting table (its clock starts again from 0) and one with scores into
    a table that does not evict (the scores are left out), and both train on."""
    from jctr.config import parse_config
    from jctr.train.trainer import Trainer

    def cfg(evicts, **solver):
        c = _evicting(tmp_path, capacity=100_000, max_iter=8, eval_interval=100, snapshot=4,
                      **solver)
        if not evicts:
            c["layers"][1].pop("eviction")
        return c

    Trainer(parse_config(cfg(False)), log=lambda s: None).fit()
    on = Trainer(parse_config(cfg(True)), log=lambda s: None)
    assert on.restore_checkpoint(4) == 4
    assert int(on.state.embeddings[0].table.clock) == 0  # no scores stored: from 0
    on.fit()  # to iteration 8, whose snapshot holds scores
    assert int(on.state.embeddings[0].table.clock) == 4
    off = Trainer(parse_config(cfg(False)), log=lambda s: None)
    assert off.restore_checkpoint(8) == 8
    assert off.state.embeddings[0].table.row_score.shape[0] == 0
    off.fit(max_iter=10)


def test_a_spilling_table_trains_the_model_of_a_table_with_room(tmp_path):
    """Issue 36 point 2's spill: a 5,000-row table of 10,590 keys (every batch's keys fit;
    10k evictions in 30 steps) with
    ``"eviction": {"policy": "lru", "spill": <folder>}`` writes every evicted row (vector, Adam's
    moments, slot) to RocksDB and a returning key takes it back, so it trains the model a
    table with room for every key trains: the same loss at every iteration and the same
    evaluations (the evaluation reads spilled keys' vectors from the database). A checkpoint
    holds the spilled rows too: a run resumed from iteration 13 (its database rewritten from
    the checkpoint) goes on to the same losses. A table on several devices is refused."""
    from jctr.config import parse_config
    from jctr.sharding.plan import PlanError
    from jctr.train.trainer import Trainer

    def run(cfg, **kw):
        t = Trainer(parse_config(cfg), log=lambda s: None, **kw)
        t.fit()
        return t

    def losses(t, kind="train"):
        key = "loss" if kind == "train" else "metrics"
        return {h["iter"]: h.get(key) for h in t.history if h["kind"] == kind}

    roomy = _evicting(tmp_path, capacity=100_000, snapshot_prefix=str(tmp_path / "roomy_"))
    roomy["layers"][1].pop("eviction")
    room = run(roomy)

    def spilling(**solver):
        cfg = _evicting(tmp_path, capacity=5000, **solver)
        cfg["layers"][1]["eviction"]["spill"] = str(tmp_path / "spill")
        return cfg

    small = run(spilling())
    table = small.state.embeddings[0].table
    assert int(np.asarray(table.evicted)) > 5000 and int(np.asarray(table.overflow)) == 0
    assert losses(small) == losses(room)
    evals = losses(small, "eval")
    assert evals and evals == losses(room, "eval")

    run(spilling(max_iter=13, snapshot=13))
    resumed = Trainer(parse_config(spilling()), log=lambda s: None)
    assert resumed.restore_checkpoint() == 13
    resumed.fit()
    got = losses(resumed)
    assert sorted(got) == list(range(14, 31))
    want = losses(room)
    assert [got[i] for i in got] == [want[i] for i in got]

    eight = spilling()
    eight["solver"]["gpu"] = list(range(8))
    with pytest.raises(PlanError, match="eviction.spill.*one device"):
        Trainer(parse_config(eight), log=lambda s: None)


@pytest.mark.parametrize("policy", ["lru", "epoch_lfu"])
def test_native_eviction_makes_the_xla_choices_over_many_chunks(policy, monkeypatch):
    """Batches of 2,000 distinct keys, most of them new, through a full 2,000-row table
    (chunks of 250 new keys, four samples each: many claims contested, several rounds):
    the native kernel and the XLA formulation leave the same key -> row map, scores and
    counts after every step. (Every new key finds a free slot here: when a batch brings more
    new keys than free slots, which of them get one differs between the two finds.)"""
    capacity = 2000
    ev = EvictionConfig(policy, epoch_steps=3, samples=4)
    rng = np.random.default_rng(5)
    batches = [rng.choice(12_000, 2000, replace=False).astype(np.int64) for _ in range(6)]
    tables = {}
    for kernels in ("auto", "reference"):
        monkeypatch.setenv("JCTR_KERNELS", kernels)
        step = jax.jit(lambda t, k: lookup(t, k, jnp.ones(k.shape, bool), capacity,
                                           insert=True, eviction=ev))
        table, seen = create_table(capacity, ev), []
        for keys in batches:
            table, lk = step(table, jnp.asarray(keys))
            seen.append((export_items(table), np.asarray(table.row_score).copy(),
                         int(table.evicted), int(table.overflow), np.asarray(lk.rows)))
        tables[kernels] = seen
    for i, (a, b) in enumerate(zip(tables["auto"], tables["reference"])):
        np.testing.assert_array_equal(a[0][0], b[0][0], err_msg=f"keys by row, step {i}")
        np.testing.assert_array_equal(a[1], b[1], err_msg=f"scores, step {i}")
        assert a[2:4] == b[2:4], i
        np.testing.assert_array_equal(a[4], b[4], err_msg=f"rows, step {i}")
    assert tables["auto"][-1][2] > 5000 and tables["auto"][-1][3] < 1000  # evicted, in numbers
