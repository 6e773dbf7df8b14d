"""Config files and overrides a user gets wrong: each is one clear line and exit status 2."""

import math

import pytest

from jctr.config import ConfigError
from jctr.train.cli import main
from jctr.train.trainer import Trainer
from tests.faults.harness import run_main, small_config, write_config

NAN, INF = math.nan, math.inf


def _set(*path_and_value):
    *path, value = path_and_value

    def mutate(cfg):
        node = cfg
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return mutate


_DELETE = object()

CASES = {
    # name: (mutation, pattern of the error line)
    "nan learning rate": (_set("optimizer", "sgd_hparam", "learning_rate", NAN),
                          r"optimizer\.sgd_hparam\.learning_rate: expected a positive finite "
                          r"number, got NaN"),
    "infinite learning rate": (_set("optimizer", "sgd_hparam", "learning_rate", INF),
                               r"learning_rate: .*got Infinity"),
    "negative infinite warmup": (_set("optimizer", "sgd_hparam", "warmup_steps", -INF),
                                 r"warmup_steps: expected a non-negative integer"),
    "huge float": (_set("optimizer", "sgd_hparam", "learning_rate", 1e308 * 10),
                   r"learning_rate: .*Infinity"),
    "nan regularizer lambda": (lambda c: c["layers"][-1].update(regularizer="L2",
                                                                **{"lambda": NAN}),
                               r"layers\[8\]\.lambda: expected a finite number >= 0"),
    "nan dropout rate": (lambda c: c["layers"].insert(4, {
        "name": "drop", "type": "Dropout", "bottom": "bot_fc1", "top": "drop", "rate": NAN}),
        r"layers\[4\]\.rate: expected a number in"),
    "nan AUC threshold": (_set("solver", "eval_metrics", ["AUC:nan"]),
                          r"solver\.eval_metrics\[0\]: AUC threshold must be a number"),
    "nan all2all factor": (_set("solver", "all2all_capacity_factor", NAN),
                           r"all2all_capacity_factor: expected a finite number"),
    "infinite synthetic alpha": (_set("layers", 0, "synthetic", "alpha", INF),
                                 r"synthetic\.alpha: expected a positive finite number"),
    "nan target weight": (lambda c: c["layers"][-1].update(target_weight=[NAN]),
                          r"target_weight: expected a list of finite numbers"),
    "batchsize zero": (_set("solver", "batchsize", 0),
                       r"solver\.batchsize: expected a positive integer, got 0"),
    "max_iter zero": (_set("solver", "max_iter", 0), r"solver\.max_iter: expected a positive"),
    "display zero": (_set("solver", "display", 0), r"solver\.display: expected a positive"),
    "eval_interval zero": (_set("solver", "eval_interval", 0), r"solver\.eval_interval"),
    "eval_batches zero": (_set("solver", "eval_batches", 0), r"solver\.eval_batches"),
    "batchsize as text": (_set("solver", "batchsize", "512"), r"batchsize: .*got \"512\""),
    "unknown solver key": (_set("solver", "max_iters", 5), r"solver\.max_iters: unknown key"),
    "unknown nan_policy": (_set("solver", "nan_policy", "ignore"),
                           r"solver\.nan_policy: expected one of \"stop\", \"skip\""),
    "unknown compute dtype": (_set("solver", "compute_dtype", "fp8"), r"compute_dtype"),
    "bad mixed precision": (_set("solver", "mixed_precision", 100), r"mixed_precision"),
    "gpu mixed lists": (_set("solver", "gpu", [0, [1]]), r"solver\.gpu: .*do not mix"),
    "gpu negative": (_set("solver", "gpu", [-1]), r"solver\.gpu: expected"),
    "gpu twice": (_set("solver", "gpu", [0, 0]), r"lists a device twice"),
    # two nodes in one process run side by side on CPU; more than the process has is refused
    # (the suite forces 8 host devices: the user's own count stands)
    "gpu of nodes beyond this process's devices": (
        _set("solver", "gpu", [list(range(8)), list(range(8))]),
        r"solver\.gpu: lists 2 nodes, run by this process as 16 host devices, but it has 8; "
        r"start one process per node: scripts/launch_local\.sh 2 "),
    "gpu that does not exist": (_set("solver", "gpu", [99]), r"solver\.gpu: device 99 does"),
    "negative snapshot": (_set("solver", "snapshot", -1), r"solver\.snapshot: expected a non"),
    "zero snapshot_keep": (_set("solver", "snapshot_keep", 0), r"snapshot_keep"),
    "vocabulary zero": (_set("layers", 1, "sparse_embedding_hparam",
                             "max_vocabulary_size_per_gpu", 0), r"max_vocabulary_size_per_gpu"),
    "vector size text": (_set("layers", 1, "sparse_embedding_hparam", "embedding_vec_size", "8"),
                         r"embedding_vec_size"),
    "unknown combiner": (_set("layers", 1, "sparse_embedding_hparam", "combiner", 7),
                         r"combiner: expected 0 \(sum\) or 1 \(mean\)"),
    "unknown optimizer": (_set("optimizer", "type", "Adamax"), r"optimizer\.type: expected one"),
    "hparam of another optimizer": (_set("optimizer", "adam_hparam", {}),
                                    r"adam_hparam: belongs to optimizer type \"Adam\""),
    "unknown layer type": (_set("layers", 2, "type", "Dense"), r"layers\[2\]\.type: unknown"),
    "unknown bottom": (_set("layers", 3, "bottom", "nowhere"), r"layers\[3\]\.bottom"),
    "duplicate layer name": (_set("layers", 3, "name", "bot_fc1"), r"duplicate layer name"),
    "no loss layer": (lambda c: c["layers"].pop(), r"layers: expected exactly one loss layer"),
    "no data layer": (lambda c: c["layers"].pop(0), r"layers\[0\]\.type: the first layer"),
    "missing eval_source": (_set("layers", 0, "eval_source", _DELETE),
                            r"layers\[0\]\.eval_source: required field is missing"),
    "check Sum for Parquet": (lambda c: c["layers"][0].update(format="Parquet"),
                              r"layers\[0\]\.check: format Parquet has no checksum"),
    "Raw without num_samples": (lambda c: c["layers"][0].update(format="Raw", check="None"),
                                r"layers\[0\]\.num_samples: required for format Raw"),
    "one-hot input with fewer features than slots": (
        _set("layers", 0, "sparse", 0, "max_feature_num_per_sample", 4),
        r"max_feature_num_per_sample: one-hot input"),
    "solver not an object": (_set("solver", [1]), r"solver: expected an object"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_error(tmp_path, capsys, name):
    mutate, pattern = CASES[name]
    cfg = small_config(tmp_path)
    mutate(cfg)
    path = write_config(tmp_path, cfg)
    run_main(main, ["--config", path], capsys, pattern=pattern, roots=(tmp_path,))


def test_unreadable_and_invalid_config_files(tmp_path, capsys):
    run_main(main, ["--config", str(tmp_path / "missing.json")], capsys,
             pattern=r"missing\.json: <file>: cannot read config: No such file")
    bad = tmp_path / "bad.json"
    bad.write_text('{"solver": {"max_iter": 3,}}')
    run_main(main, ["--config", str(bad)], capsys,
             pattern=r"bad\.json: line 1 column \d+: invalid JSON", roots=(tmp_path,))


FLAGS = {
    "--max-iter 0": (["--max-iter", "0"], r"--max-iter: expected a positive integer, got 0"),
    "--max-iter -3": (["--max-iter", "-3"], r"--max-iter: expected a positive integer"),
    "--num-epochs 0": (["--num-epochs", "0"], r"--num-epochs: expected a positive integer"),
    "--batchsize 0": (["--batchsize", "0"], r"--batchsize: expected a positive integer"),
    "--batchsize-eval 0": (["--batchsize-eval", "0"], r"--batchsize-eval: expected a positive"),
    "--display 0": (["--display", "0"], r"--display: expected a positive integer"),
    "--eval-interval 0": (["--eval-interval", "0"],
                          r"--eval-interval: expected an integer >= 1 or \"epoch\""),
    "--eval-batches 0": (["--eval-batches", "0"], r"--eval-batches: expected a positive"),
    "--snapshot -1": (["--snapshot", "-1"], r"--snapshot: expected a non-negative integer"),
    "--seed -1": (["--seed", "-1"], r"--seed: expected a non-negative integer"),
    "--compute-dtype fp8": (["--compute-dtype", "fp8"], r"--compute-dtype: expected one of"),
    "--nan-policy maybe": (["--nan-policy", "maybe"], r"--nan-policy: expected one of"),
    "--gpu letters": (["--gpu", "a,b"], r"--gpu: expected device ids like 0,1,2,3"),
    "--gpu negative": (["--gpu", "-1"], r"--gpu: expected a list of device indices"),
    "--gpu two nodes beyond the devices": (["--gpu", "0,1,2,3,4,5,6,7;0"],
                                           r"solver\.gpu: lists 2 nodes, run by this process "
                                           r"as 9 host devices, but it has 8"),
    "--max-iter text": (["--max-iter", "ten"], r"argument --max-iter: invalid int value"),
    "unknown flag": (["--max_iter", "3"], r"unrecognized arguments"),
    "--batchsize not dividing 8 devices": (["--gpu", "0,1,2", "--batchsize", "256"],
                                           r"solver\.batchsize: 256 does not split evenly"),
}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_cli_flag_error(tmp_path, capsys, name):
    flags, pattern = FLAGS[name]
    path = write_config(tmp_path, small_config(tmp_path))
    run_main(main, ["--config", path, *flags], capsys, pattern=pattern, roots=(tmp_path,))


@pytest.mark.parametrize("overrides,pattern", [
    ({"max_iter": 0}, r"override solver\.max_iter: expected a positive integer"),
    ({"batchsize": 0}, r"override solver\.batchsize"),
    ({"display": 0}, r"override solver\.display"),
    ({"eval_batches": -2}, r"override solver\.eval_batches"),
    ({"log_dir": ""}, r"override solver\.log_dir: expected a non-empty string"),
    ({"max_iters": 4}, r"solver\.max_iters: unknown key"),
])
def test_python_overrides_are_validated_like_the_file(tmp_path, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Trainer.from_config(small_config(tmp_path), **overrides)
    assert not (tmp_path / "data").exists()  # refused before anything was generated


def test_a_key_given_twice_is_refused_with_its_path(tmp_path, capsys):
    """json (and PyYAML) keep the last of two equal keys silently: a setting the user wrote
    was ignored. Every config reader refuses it with its JSON path (issue 35)."""
    from jctr.config.hps import load_ps_config
    from jctr.config.online import load_online_config

    cfg = tmp_path / "twice.json"
    cfg.write_text('{"solver": {"max_iter": 3, "batchsize": 64, "max_iter": 5},'
                   ' "optimizer": {"type": "SGD"}, "layers": []}')
    run_main(main, ["--config", str(cfg)], capsys,
             pattern=r"twice\.json: solver\.max_iter: given twice in the same object",
             roots=(tmp_path,))
    ps = tmp_path / "ps.json"
    ps.write_text('{"models": [{"model": "m", "model": "n"}]}')
    with pytest.raises(ConfigError, match=r"ps\.json: models\[0\]\.model: given twice"):
        load_ps_config(str(ps))
    online = tmp_path / "online.yaml"
    online.write_text("model: a.json\ntable_parameters:\n  click_coeff: 1\n"
                      "  click_coeff: 2\n")
    with pytest.raises(ConfigError, match=r"online\.yaml: table_parameters\.click_coeff: "
                                          "given twice"):
        load_online_config(str(online))


@pytest.mark.parametrize("key", ["click_coeff", "nonclk_coeff"])
def test_negative_score_weights_are_refused(tmp_path, key):
    """A negative click_coeff made clicked keys score below unclicked ones: the first shrink
    deleted 63% of the keys. Refused in the streaming config and in SparseAdaGradSGDRule's."""
    from jctr.config import parse_config
    from jctr.config.online import parse_online_config
    from tests.faults.harness import small_config

    with pytest.raises(ConfigError, match=rf"table_parameters\.{key}: expected a finite "
                                          r"number >= 0\.0, got -0\.5"):
        parse_online_config({"model": "m.json", "train_data_dir": "d", "start_day": "20190720",
                             "end_day": "20190720", "split_interval": 720,
                             "split_per_pass": 1, "save_model_path": "s",
                             "table_parameters": {key: -0.5}}, str(tmp_path / "o.yaml"))
    raw = small_config(tmp_path)
    raw["layers"][1]["optimizer"] = {"type": "SparseAdaGradSGDRule", key: -0.5}
    with pytest.raises(ConfigError, match=rf"optimizer\.{key}: expected a finite number >= "
                                          r"0\.0, got -0\.5"):
        parse_config(raw)
