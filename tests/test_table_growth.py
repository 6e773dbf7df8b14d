"""Tables that grow (issue 36 point 3, ``sparse_embedding_hparam.growable``)."""

import numpy as np
import pytest

from jctr.config import ConfigError, parse_config
from jctr.train.table_growth import capacity_for
from jctr.train.trainer import Trainer
from tests.conftest import tiny_config


def _cfg(tmp_path, capacity, growable=True, **solver):
    base = dict(max_iter=24, display=1, eval_interval=12, eval_batches=2,
                snapshot_prefix=str(tmp_path / "run_"))
    base.update(solver)
    cfg = tiny_config(tmp_path, "dlrm", **base)
    hp = cfg["layers"][1]["sparse_embedding_hparam"]
    hp["max_vocabulary_size_per_gpu"] = capacity
    if growable:
        hp["growable"] = True
    cfg["layers"][1]["optimizer"] = {"type": "Adam", "update_type": "Local",
                                     "adam_hparam": {"learning_rate": 0.01}}
    return cfg


def _losses(t):
    return {h["iter"]: h["loss"] for h in t.history if h["kind"] == "train"}


def test_capacity_doubles_until_two_steps_fit():
    assert capacity_for(100, 10, 20) == 100
    assert capacity_for(100, 70, 20) == 200
    assert capacity_for(100, 10, 400) == 1600


def test_a_growable_table_trains_as_a_large_one_and_resumes(tmp_path):
    """A table of 64 rows that meets thousands of keys doubles between steps (each growth
    printed and logged) and trains exactly as the same model with a table large enough from
    the start: the same loss at every iteration. A checkpoint of the grown table restores
    into the config's small table (it grows first) and goes on with the same losses."""
    lines = []
    big = Trainer(parse_config(_cfg(tmp_path / "big", 1 << 16, growable=False)),
                  log=lambda s: None)
    big.fit()
    grown = Trainer(parse_config(_cfg(tmp_path / "g", 64, snapshot=12)), log=lines.append)
    grown.fit()
    growth = [x for x in lines if " grew from " in x]
    assert growth and growth[0].startswith("[jctr] table sparse_embedding1 grew from 64 to ")
    assert grown.specs[0].capacity > 1000
    assert [h["kind"] for h in grown.history].count("table_growth") == len(growth)
    assert _losses(grown) == _losses(big)

    resumed = Trainer(parse_config(_cfg(tmp_path / "g", 64, snapshot=12)),
                      log=lambda s: None)
    assert resumed.restore_checkpoint(12) == 12
    assert resumed.specs[0].capacity > 64
    resumed.fit()
    want = _losses(big)
    got = _losses(resumed)
    assert sorted(got) == list(range(13, 25))
    assert all(got[i] == want[i] for i in got)


def test_growth_stops_at_the_memory_ceiling(tmp_path, monkeypatch):
    """A growth whose step does not fit the machine is refused with the plan's figure: the
    table keeps its rows and, full, stops training with TableFullError as before."""
    from jctr.embedding import TableFullError
    from jctr.sharding.plan import PlanError

    lines = []
    t = Trainer(parse_config(_cfg(tmp_path, 64, max_iter=30)), log=lines.append)

    def refuse(*a, **k):
        raise PlanError("the step needs 9.9 TiB, the machine has 23 GiB")

    monkeypatch.setattr("jctr.train.step_memory.plan_step_memory", refuse)
    with pytest.raises(TableFullError, match="sparse_embedding1"):
        t.fit()
    assert any("cannot grow to" in x and "9.9 TiB" in x for x in lines)
    assert t.specs[0].capacity == 64


def test_growable_refused_where_there_is_nothing_to_grow(tmp_path):
    cfg = _cfg(tmp_path, 64)
    cfg["layers"][1]["type"] = "LocalizedSlotSparseEmbeddingHash"
    cfg["layers"][1]["sparse_embedding_hparam"]["slot_size_array"] = [10] * 26
    with pytest.raises(ConfigError, match="growable: a LocalizedSlot table sized by "
                                          "slot_size_array"):
        parse_config(cfg)
    assert np.isfinite(capacity_for(1, 0, 1))


def test_growth_on_eight_devices(tmp_path):
    """A growable table spread over 8 host devices by key hash grows as one: the same losses
    as the same run with a large table."""
    out = {}
    for name, cap, grow in (("big", 1 << 14, False), ("g", 16, True)):
        cfg = _cfg(tmp_path / name, cap, growable=grow, max_iter=10, eval_interval=100)
        cfg["solver"]["gpu"] = list(range(8))
        cfg["layers"][1]["sparse_embedding_hparam"]["replicated"] = False
        t = Trainer(parse_config(cfg), log=lambda s: None)
        t.fit()
        out[name] = (_losses(t), t.specs[0].capacity)
    assert out["g"][1] > 16
    assert out["g"][0] == out["big"][0]


def test_the_best_weights_kept_before_a_growth_come_back_grown(tmp_path):
    """Early stopping keeps a host copy of the best evaluation's state; when the table grows
    after it, the copy's rows move to the grown table too, so restoring the best at the end
    gives a state the grown steps take (and evaluate)."""
    from tests.test_epochs import scripted

    cfg = _cfg(tmp_path, 64, max_iter=24, eval_interval=4)
    cfg["solver"]["early_stopping"] = {"metric": "AUC", "patience": 3}
    lines = []
    t = Trainer(parse_config(cfg), log=lines.append)
    scripted(t, [0.9, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    t.fit()
    assert int(t.state.step) == 4  # the best evaluation's state
    assert any(" grew from " in x for x in lines)
    rows = int(np.asarray(t.state.embeddings[0].table.size))
    assert 0 < rows <= t.specs[0].capacity
    assert np.isfinite(Trainer.evaluate(t, num_batches=1)["AUC"])  # a real evaluation
