"""Training configs for a converted dataset, with the hyper-parameters users of FuxiCTR and Keras
CTR libraries publish: Adam 1e-3, an MLP of 400x3 with dropout 0.2 (DLRM: its top MLP),
embeddings of 16, L2 on embedding rows, the training data shuffled every epoch, evaluation each
epoch, early stopping on validation AUC (patience 2, best weights kept) and the learning rate
x0.1 on plateau.

Example::

    layer, rows = jctr.data.tools.from_csv.convert(...)
    cfg = tabular_config("deepfm", layer, train_rows=rows["train"], run_dir="data/mine")
"""

from __future__ import annotations

from jctr.config.model_layers import dcn_layers, deepfm_layers, dlrm_layers, wdl_layers

MODELS = ("deepfm", "dcn", "dlrm", "wdl")


def _batchsize(train_rows: int) -> int:
    """A power of two giving at least ~20 steps an epoch, between 16 and 4096."""
    b = 16
    while b < 4096 and b * 2 * 20 <= train_rows:
        b *= 2
    return b


def _embedding(name: str, dim: int, capacity: int, l2: float) -> dict:
    return {"name": name, "type": "DistributedSlotSparseEmbeddingHash", "bottom": "data1",
            "top": name, "sparse_embedding_hparam": {
                "max_vocabulary_size_per_gpu": capacity, "embedding_vec_size": dim,
                "combiner": 0, "l2_lambda": l2,
                # as small as the PyTorch libraries' normal(0, 1e-4): the FM and cross terms
                # start near zero instead of swamping the first epochs
                "init_range": 1e-4}}


def tabular_config(model: str, data_layer: dict, *, train_rows: int, run_dir: str,
                   embedding_dim: int = 16, hidden: tuple[int, ...] = (400, 400, 400),
                   dropout: float = 0.2, l2_lambda: float = 1e-5, max_epochs: int = 100,
                   seed: int = 0) -> dict:
    """A whole JSON config (solver, optimizer, layers) for ``model`` on a Data layer whose
    ``sparse`` input ``data1`` holds one key per field (``slot_size_array`` gives the sizes).
    Checkpoints and logs go under ``run_dir``; the training data is shuffled every epoch
    (FuxiCTR's data loader does). Relative paths (the Data layer's, ``run_dir``) are taken
    from the config file's folder (``solver.paths_relative_to: "config"``)."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    slots = data_layer["sparse"][0]["slot_num"]
    dense_dim = data_layer["dense"]["dense_dim"]
    capacity = int(sum(data_layer["slot_size_array"]))
    dim = embedding_dim
    embeddings = [_embedding("sparse_embedding1", dim, capacity, l2_lambda)]
    if model == "deepfm":
        embeddings.append(_embedding("sparse_embedding2", 1, capacity, l2_lambda))
        layers = deepfm_layers(dense_dim, slots, dim, hidden, dropout)
    elif model == "dcn":
        layers = dcn_layers(dense_dim, slots, dim, 3, hidden, dropout)
    elif model == "dlrm":
        layers = dlrm_layers(dense_dim, slots, dim, (256, 64, dim), (*hidden, 1), dropout)
    else:
        embeddings.insert(0, _embedding("sparse_embedding2", 1, capacity, l2_lambda))
        layers = wdl_layers(dense_dim, slots, dim, slots, hidden, dropout)
    batch = _batchsize(train_rows)
    run = run_dir.rstrip("/") + "/"
    solver = {
        "num_epochs": max_epochs, "batchsize": batch, "batchsize_eval": batch,
        "display": max(1, train_rows // batch // 4 or 1), "eval_interval": "epoch",
        "eval_metrics": ["AUC", "LogLoss"], "input_key_type": "I64", "seed": seed,
        "early_stopping": {"metric": "AUC", "patience": 2},
        "lr_policy": "plateau", "lr_plateau": {"factor": 0.1, "patience": 1, "min_lr": 1e-6},
        "snapshot_prefix": run, "log_dir": run + "logs", "paths_relative_to": "config",
    }
    optimizer = {"type": "Adam", "update_type": "Local",
                 "adam_hparam": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999,
                                 "epsilon": 1e-8}}
    return {"solver": solver, "optimizer": optimizer,
            "layers": [{**data_layer, "shuffle": True}, *embeddings, *layers]}
