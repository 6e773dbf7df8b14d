"""The documentation: every config field is described, the generated config reference is current
and its defaults are the parser's, and the MkDocs site builds with --strict."""

import dataclasses
import os
import shutil
import subprocess
import sys
import types

from jctr.config import hps, load_config, reference
from jctr.config.hps import parse_ps_config
from jctr.config.layer_types import LAYER_TYPES
from jctr.config.reader import ObjectReader
from jctr.config.reference import SERVING_CLAUSES, TRAINING_CLAUSES
from tests.conftest import ROOT

PAGE = os.path.join(ROOT, "docs", "config-reference.md")


def test_every_config_field_and_layer_type_has_a_description():
    assert reference.undocumented_fields() == []
    assert len(reference.config_dataclasses()) >= 25


def test_a_field_without_a_docstring_is_reported(monkeypatch, tmp_path):
    module = types.ModuleType("fake_config")
    source = '''
from dataclasses import dataclass

@dataclass(frozen=True)
class Knobs:
    documented: int = 1
    """What it does."""
    forgotten: float = 0.5
'''
    path = tmp_path / "fake_config.py"
    path.write_text(source, encoding="utf-8")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "fake_config", module)
    exec(compile(source, str(path), "exec"), module.__dict__)
    monkeypatch.setattr(reference, "DOCUMENTED_MODULES", (module,))
    assert reference.field_docs(module.Knobs) == {"documented": "What it does."}
    assert reference.undocumented_fields() == ["fake_config.Knobs.forgotten"]


def test_reference_page_is_what_the_code_generates():
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    assert reference.page_with_reference(page) == page, (
        "docs/config-reference.md is stale: python -m jctr.config.reference --write "
        "docs/config-reference.md")
    # every key of every clause is on the page, with the clause it belongs to
    for clause in TRAINING_CLAUSES + SERVING_CLAUSES:
        assert f"Path: `{clause.path}`." in page
        for key, *_ in reference.clause_rows(clause):
            assert f"`{key.split(' ')[0]}`" in page, key
    for name in LAYER_TYPES:
        assert f"| `{name}` |" in page


def _check_defaults(parsed, clause, given=()):
    """Every field the JSON left out holds the default the reference prints."""
    checked = 0
    for f in dataclasses.fields(clause.cls):
        if f.name in given or f.name in clause.defaults or clause.keys.get(f.name, 1) is None:
            continue
        if f.default is not dataclasses.MISSING:
            want = f.default
        elif f.default_factory is not dataclasses.MISSING:
            want = f.default_factory()
        else:
            continue  # required: the JSON gave it
        assert getattr(parsed, f.name) == want, f"{clause.path}.{f.name}"
        checked += 1
    return checked


def _clause(cls):
    return next(c for c in TRAINING_CLAUSES + SERVING_CLAUSES if c.cls is cls)


def test_documented_defaults_are_what_the_parser_fills_in():
    from jctr.config import schema

    raw = {
        "solver": {"max_iter": 1, "lr_policy": "plateau", "lr_plateau": {},
                   "early_stopping": {}},
        "optimizer": {"type": "Adam"},
        "layers": [
            {"type": "Data", "source": "a.txt", "eval_source": "b.txt",
             "label": {"top": "label", "label_dim": 1}, "dense": {"top": "dense", "dense_dim": 2},
             "sparse": [{"top": "s", "type": "DistributedSlot", "slot_num": 2,
                         "max_feature_num_per_sample": 2}],
             "synthetic": {"num_samples": 10, "eval_num_samples": 10}},
            {"type": "DistributedSlotSparseEmbeddingHash", "name": "e", "bottom": "s",
             "top": "emb", "sparse_embedding_hparam": {"max_vocabulary_size_per_gpu": 10,
                                                       "embedding_vec_size": 4}},
            {"type": "Reshape", "name": "r", "bottom": "emb", "top": "flat", "leading_dim": 8},
            {"type": "Concat", "name": "c", "bottom": ["flat", "dense"], "top": "x"},
            {"type": "InnerProduct", "name": "fc", "bottom": "x", "top": "y",
             "fc_param": {"num_output": 1}},
            {"type": "BinaryCrossEntropyLoss", "name": "loss", "bottom": ["y", "label"],
             "top": "l"},
        ],
    }
    cfg = load_config(raw)
    n = 0
    n += _check_defaults(cfg.solver, _clause(schema.SolverConfig),
                         given=("max_iter", "lr_policy", "lr_plateau", "early_stopping"))
    n += _check_defaults(cfg.solver.early_stopping, _clause(schema.EarlyStoppingConfig))
    n += _check_defaults(cfg.solver.lr_plateau, _clause(schema.PlateauConfig))
    n += _check_defaults(cfg.optimizer, _clause(schema.OptimizerConfig))
    n += _check_defaults(cfg.data, _clause(schema.DataConfig), given=("synthetic",))
    n += _check_defaults(cfg.data.sparse[0], _clause(schema.SparseInputConfig))
    n += _check_defaults(cfg.data.synthetic, _clause(schema.SyntheticConfig))
    n += _check_defaults(cfg.embeddings[0], _clause(schema.EmbeddingConfig))
    # the derived defaults are what the reference says they are
    s = cfg.solver
    assert (s.batchsize_eval, s.compute_dtype) == (s.batchsize, "float32")
    assert [m.name for m in s.eval_metrics] == ["AUC"] and s.gpu == ((0,),)
    assert (s.early_stopping.metric, s.early_stopping.mode) == ("AUC", "max")
    assert cfg.optimizer.learning_rate == 0.001 and cfg.data.name == "data"
    assert cfg.data.sparse[0].max_nnz == 2 and cfg.embeddings[0].init_range is None
    sgd = load_config({**raw, "optimizer": {"type": "SGD"}})
    assert sgd.optimizer.learning_rate == 0.01
    assert n >= 55

    # every dense layer type's parameters: left out, they take the printed defaults
    minimal = {"fc_param": {"num_output": 3}, "ranges": [[0, 1]],
               "weight_dims": [2, 3], "out_dim": 4, "mc_param": {"num_layers": 2}}
    for name, spec in LAYER_TYPES.items():
        params = spec.parse(ObjectReader(dict(minimal), f"layers[{name}]", None))
        assert type(params) is spec.params
        for f in dataclasses.fields(spec.params):
            if f.default is not dataclasses.MISSING:
                assert getattr(params, f.name) == f.default, (name, f.name)


def test_documented_parameter_server_defaults_are_the_parsers(tmp_path):
    ps = parse_ps_config({"models": [{"model": "m", "max_batch_size": 8, "dense_file": "d",
                                      "network_file": "n", "sparse_files": ["s1", "s2"]}]},
                         source=str(tmp_path / "ps.json"))
    n = _check_defaults(ps, _clause(hps.ParameterServerConfig), given=("models",))
    n += _check_defaults(ps.volatile_db, _clause(hps.VolatileDatabaseParams))
    n += _check_defaults(ps.persistent_db, _clause(hps.PersistentDatabaseParams))
    n += _check_defaults(ps.update_source, _clause(hps.UpdateSourceParams))
    model = ps.models[0]
    n += _check_defaults(model, _clause(hps.InferenceParams))
    assert model.default_value_for_each_table == (0.0, 0.0)
    assert model.embedding_table_names == ("sparse_embedding1", "sparse_embedding2")
    assert n > 50


def test_docs_site_builds_strict(tmp_path):
    """``mkdocs build --strict`` (the docs extra, in dev): a broken link, a page missing from
    the nav or a bad anchor fails the build."""
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    assert mkdocs, "mkdocs is missing: pip install -e '.[docs]'"
    site = tmp_path / "site"
    out = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    html = (site / "config-reference" / "index.html").read_text(encoding="utf-8")
    assert html.count("<table>") == len(TRAINING_CLAUSES) + len(SERVING_CLAUSES) + 2
    for page in ("getting-started", "data-formats", "coming-from-hugectr",
                 "devices-and-hosts", "checkpoints", "serving", "troubleshooting"):
        assert (site / page / "index.html").stat().st_size > 10_000, page
