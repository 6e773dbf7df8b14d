"""The sparse path never materialises a gradient (or any temporary) the size of a table."""

import jax
import jax.numpy as jnp
import pytest

from jctr.config import parse_config
from jctr.data.batch import Batch
from jctr.models.ctr import build_model
from jctr.train.dense_optimizer import dense_optimizer
from jctr.train.step import make_train_step
from tests.conftest import load_json

CAPACITY, DIM = 10_000_000, 64
TABLE_BYTES = CAPACITY * DIM * 4


def _compiled_step(update_type: str, opt_type: str = "Adam"):
    raw = load_json("dlrm_synthetic.json")
    emb = raw["layers"][1]
    emb["sparse_embedding_hparam"].update(max_vocabulary_size_per_gpu=CAPACITY,
                                          embedding_vec_size=DIM)
    emb["optimizer"] = {"type": opt_type, "update_type": update_type}
    for layer in raw["layers"]:
        if layer.get("name") == "bot_fc2":
            layer["fc_param"]["num_output"] = DIM
    raw["layers"][0].pop("synthetic")
    cfg = parse_config(raw)
    step_config, init_model = build_model(cfg)
    tx = dense_optimizer(cfg.optimizer)
    # abstract: nothing the size of the table is allocated
    state = jax.eval_shape(lambda: init_model(tx))
    b, slots = cfg.solver.batchsize, cfg.data.sparse[0].slot_num
    batch = Batch(jax.ShapeDtypeStruct((b, 1), jnp.float32),
                  jax.ShapeDtypeStruct((b, 13), jnp.float32),
                  (jax.ShapeDtypeStruct((b * slots,), jnp.int64),),
                  (jax.ShapeDtypeStruct((b * slots,), jnp.int32),),
                  jax.ShapeDtypeStruct((b,), jnp.bool_))
    step = jax.jit(make_train_step(step_config, tx), donate_argnums=0)
    return step.lower(state, batch).compile(), state


@pytest.mark.parametrize("opt_type", ["Adam", "SGD"])
def test_local_update_temporaries_are_far_below_the_table(opt_type):
    compiled, state = _compiled_step("Local", opt_type)
    mem = compiled.memory_analysis()
    assert mem is not None, "XLA-CPU reports memory analysis for compiled programs"
    # state (values + 2 Adam slots + hash arrays) is aliased in place: the step needs only
    # batch-sized scratch, not a [capacity, dim] gradient. On a GPU the insert kernel also
    # takes one int32 claim counter per hash slot (jctr.ops.pallas_hash: Pallas' Triton
    # compare-and-swap takes no index), a quarter of the table's values here.
    claims = 0
    if jax.default_backend() == "gpu":
        claims = 4 * state.embeddings[0].table.slot_keys.shape[0]
    assert mem.temp_size_in_bytes < TABLE_BYTES / 50 + claims, mem
    assert mem.output_size_in_bytes - mem.alias_size_in_bytes < TABLE_BYTES / 50, mem


def test_global_update_does_pay_for_a_dense_gradient():
    # the same measurement sees the whole-table temporaries of update_type Global, so the
    # bound above is a real check
    mem = _compiled_step("Global")[0].memory_analysis()
    assert mem is not None
    assert mem.temp_size_in_bytes >= TABLE_BYTES, mem
