import copy
import json

import pytest

from jctr.config import ConfigError, load_config, parse_config
from tests.conftest import CONFIGS, load_json

SHIPPED = ["dlrm", "dcn", "deepfm", "wdl", "dlrm_synthetic", "dcn_synthetic",
           "deepfm_synthetic", "wdl_synthetic"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_parse(name):
    cfg = load_config(f"{CONFIGS}/{name}.json")
    assert cfg.embeddings and cfg.layers[-1].is_loss
    assert (cfg.solver.max_iter or cfg.solver.num_epochs) > 0


def test_clauses_in_any_order_and_defaults():
    raw = load_json("dlrm_synthetic.json")
    reordered = {"layers": raw["layers"], "optimizer": raw["optimizer"], "solver": raw["solver"]}
    a, b = parse_config(raw), parse_config(reordered)
    assert a.layers == b.layers and a.solver == b.solver
    minimal = copy.deepcopy(raw)
    minimal["solver"] = {"max_iter": 10}
    cfg = parse_config(minimal)
    assert cfg.solver.batchsize == 2048 and cfg.solver.batchsize_eval == 2048
    assert cfg.solver.gpu == ((0,),) and cfg.solver.input_key_type == "I32"
    assert cfg.solver.eval_metrics[0].name == "AUC"


def test_seed_example_fields():
    raw = load_json("dlrm_synthetic.json")
    raw["solver"].update({"gpu": [[0, 1], [1, 2]], "mixed_precision": 256,
                          "eval_metrics": ["AUC:0.8025", "AverageLoss"],
                          "dense model_file": "./dense_model.bin",
                          "sparse_model_file": ["./sparse_model1.bin"]})
    raw["layers"][1]["optimizer"] = {
        "type": "Adam", "learning_rate": True,
        "adam_hparam": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999,
                        "epsilon": 0.0000001}}
    raw["optimizer"] = {"type": "SGD", "update_type": "Local",
                        "sgd_hparam": {"learning_rate": 24.0, "warmup_steps": 8000,
                                       "decay_start": 48000, "decay_steps": 24000}}
    cfg = parse_config(raw)
    s = cfg.solver
    assert s.gpu == ((0, 1), (1, 2)) and s.mixed_precision == 256
    assert s.compute_dtype == "float16" and s.auc_threshold == pytest.approx(0.8025)
    assert s.dense_model_file == "./dense_model.bin"
    assert cfg.embedding_optimizer(cfg.embeddings[0]).type == "Adam"
    assert cfg.optimizer.decay_steps == 24000 and cfg.optimizer.decay_power == 2.0


def _mutate(path, value=None, delete=False):
    raw = load_json("dlrm_synthetic.json")
    node = raw
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


def _dlrm_layer_index(raw, name):
    return next(i for i, layer in enumerate(raw["layers"]) if layer.get("name") == name)


BAD = [
    # (mutation, expected fragment of the message)
    (lambda: _mutate(["layers", 3, "fc_param", "num_output"], "abc"),
     'layers[3].fc_param.num_output: expected a positive integer, got "abc"'),
    (lambda: _mutate(["solver", "batchsize"], 0), "solver.batchsize: expected a positive integer"),
    (lambda: _mutate(["solver", "bacthsize"], 4), 'solver.bacthsize: unknown key; known keys'),
    (lambda: _mutate(["optimizer", "type"], "Adamw"), 'optimizer.type: expected one of "Adam"'),
    (lambda: _mutate(["optimizer", "update_type"], "global"), "optimizer.update_type"),
    (lambda: _mutate(["solver", "mixed_precision"], 100), "solver.mixed_precision: expected one"),
    (lambda: _mutate(["solver", "eval_metrics"], ["AUC:1.5"]), "solver.eval_metrics[0]"),
    (lambda: _mutate(["layers", 1, "sparse_embedding_hparam", "combiner"], 2),
     "layers[1].sparse_embedding_hparam.combiner: expected 0 (sum) or 1 (mean)"),
    (lambda: _mutate(["layers", 1, "bottom"], "nope"),
     'layers[1].bottom: "nope" is not a sparse input'),
    (lambda: _mutate(["layers", 3, "bottom"], "bot_fc9"),
     'layers[3].bottom: "bot_fc9" is not the top of any earlier layer'),
    (lambda: _mutate(["layers", 0, "label", "label_dim"], -1), "layers[0].label.label_dim"),
    (lambda: _mutate(["layers", 0, "sparse", 0, "type"], "Distributed"),
     "layers[0].sparse[0].type"),
    (lambda: _mutate(["layers", 1, "sparse_embedding_hparam", "max_vocabulary_size_per_gpu"],
                     -5), "max_vocabulary_size_per_gpu: expected a positive integer"),
    (lambda: _mutate(["layers", 0, "type"], "Dataa"), "layers[0].type"),
    (lambda: _mutate(["solver", "gpu"], [0, [1]]), "solver.gpu"),
    (lambda: _mutate(["optimizer", "adam_hparam"], {"learning_rate": 0.1}),
     'optimizer.adam_hparam: belongs to optimizer type "Adam"'),
    (lambda: _mutate(["layers", 0, "format"], "Raw"),
     "layers[0].check: format Raw has no checksum"),
    (lambda: _mutate(["solver", "eval_interval"], "epochs"),
     'solver.eval_interval: expected an integer >= 1 or "epoch", got "epochs"'),
    (lambda: _mutate(["solver", "early_stopping"], {"metric": "LogLoss"}),
     'solver.early_stopping.metric: expected one of "AUC", "AverageLoss", got "LogLoss"'),
    (lambda: _mutate(["solver", "early_stopping"], {"patience": 0}),
     "solver.early_stopping.patience: expected a positive integer"),
    (lambda: _mutate(["solver", "early_stopping"], {"restore": True}),
     "solver.early_stopping.restore: unknown key"),
    (lambda: _mutate(["solver", "lr_plateau"], {"factor": 0.5}),
     'solver.lr_plateau: applies with lr_policy "plateau"'),
    (lambda: {**_mutate(["solver", "lr_policy"], "plateau"),
              "solver": {**load_json("dlrm_synthetic.json")["solver"], "lr_policy": "plateau",
                         "lr_plateau": {"factor": 2}}},
     "solver.lr_plateau.factor: expected a number between 0 and 1"),
    (lambda: _mutate(["layers", 0, "test_source"], {"a": 3}),
     "layers[0].test_source.a: expected a name or a list of names"),
]


def test_epochs_early_stopping_plateau_and_test_sets_parse():
    raw = load_json("dlrm_synthetic.json")
    raw["solver"].update(eval_interval="epoch", lr_policy="plateau",
                         eval_metrics=["AUC", "LogLoss"],
                         early_stopping={"metric": "LogLoss", "patience": 3},
                         lr_plateau={"min_lr": 1e-5})
    raw["layers"][0]["test_source"] = ["a.txt", "b.txt"]
    cfg = parse_config(raw)
    s = cfg.solver
    assert s.eval_every_epoch and s.early_stopping.mode == "min"
    assert s.early_stopping.restore_best_weights and s.early_stopping.patience == 3
    assert (s.lr_plateau.metric, s.lr_plateau.mode, s.lr_plateau.factor,
            s.lr_plateau.min_lr) == ("AUC", "max", 0.1, 1e-5)
    assert cfg.data.test_sources == (("test1", "a.txt"), ("test2", "b.txt"))
    raw["layers"][0]["test_source"] = "c.txt"
    assert parse_config(raw).data.test_sources == (("test", "c.txt"),)


@pytest.mark.parametrize("make,fragment", BAD)
def test_bad_configs_name_the_path(make, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(make())
    assert fragment in str(e.value)


def test_loss_must_be_last_and_unique():
    raw = load_json("dlrm_synthetic.json")
    raw["layers"].append(copy.deepcopy(raw["layers"][-1]))
    with pytest.raises(ConfigError, match="exactly one loss layer"):
        parse_config(raw)


def test_embedding_after_dense_layer_is_an_error():
    raw = load_json("dlrm_synthetic.json")
    raw["layers"].insert(3, copy.deepcopy(raw["layers"][1]))
    with pytest.raises(ConfigError, match="embedding layers must precede"):
        parse_config(raw)


def test_shape_mismatch_found_before_training():
    from flax import nnx

    from jctr.models import build_network

    raw = load_json("dcn_synthetic.json")
    reshape = next(layer for layer in raw["layers"] if layer.get("type") == "Reshape")
    reshape["leading_dim"] = 63
    cfg = parse_config(raw)
    with pytest.raises(ConfigError, match=r"layers\[\d+\]: Reshape \"reshape1\": leading_dim 63"):
        build_network(cfg, nnx.Rngs(0))
    raw = load_json("dlrm_synthetic.json")
    inter = next(layer for layer in raw["layers"] if layer.get("type") == "Interaction")
    inter["bottom"] = ["bot_fc1", "sparse_embedding1"]
    with pytest.raises(ConfigError, match="Interaction"):
        build_network(parse_config(raw), nnx.Rngs(0))


def test_invalid_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"solver": {"max_iter": 1,}}')
    with pytest.raises(ConfigError, match=r"bad.json: line 1 column \d+: invalid JSON"):
        load_config(str(p))
    p.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="expected an object"):
        load_config(str(p))
