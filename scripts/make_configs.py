"""Write the shipped configs/*.json from the model zoo's layer lists (run after changing them).

    python scripts/make_configs.py
"""

from __future__ import annotations

import json
import os

from jctr.config.model_layers import dcn_layers, deepfm_layers, dlrm_layers, wdl_layers

# Criteo Kaggle cardinalities, capped at 1,000,000 rows per slot.
KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
          27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
KAGGLE_CAPPED = [min(c, 1_000_000) for c in KAGGLE]
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "configs")


def data_layer(name, slots, *, wide=False, multi_hot=False, synthetic=None, vocab_sizes=None,
               dense_dim=13):
    sparse = [{"top": "data1", "type": "DistributedSlot",
               "max_feature_num_per_sample": 3 * slots if multi_hot else slots,
               "max_nnz": 3 if multi_hot else 1, "slot_num": slots}]
    if wide:
        sparse.insert(0, {"top": "wide_data", "type": "DistributedSlot",
                          "max_feature_num_per_sample": 3, "max_nnz": 3, "slot_num": 1})
    layer = {"name": "data", "type": "Data",
             "source": f"./data/{name}/train/_file_list.txt",
             "eval_source": f"./data/{name}/eval/_file_list.txt",
             "check": "Sum",
             "cache_eval_data": True,
             "label": {"top": "label", "label_dim": 1},
             "dense": {"top": "dense", "dense_dim": dense_dim},
             "sparse": sparse}
    if vocab_sizes:
        layer["slot_size_array"] = vocab_sizes
    if synthetic:
        layer["synthetic"] = synthetic
    return layer


def embedding(name, bottom, vocab, dim, combiner=0, optimizer=None, init_range=None):
    out = {"name": name, "type": "DistributedSlotSparseEmbeddingHash", "bottom": bottom,
           "top": name, "sparse_embedding_hparam": {
               "max_vocabulary_size_per_gpu": vocab, "embedding_vec_size": dim,
               "combiner": combiner}}
    if init_range:
        out["sparse_embedding_hparam"]["init_range"] = init_range
    if optimizer:
        out["optimizer"] = optimizer
    return out


def solver(max_iter, batch, eval_interval, eval_batches, display):
    return {"lr_policy": "fixed", "display": display, "max_iter": max_iter, "gpu": [0],
            "batchsize": batch, "batchsize_eval": batch, "snapshot": 0,
            "snapshot_prefix": "./runs/", "eval_interval": eval_interval,
            "eval_batches": eval_batches, "eval_metrics": ["AUC", "AverageLoss"],
            "input_key_type": "I64"}


def epoch_solver(num_epochs, batch, display, patience):
    """Evaluate the whole validation set after each epoch; stop once AUC has not improved
    for ``patience`` epochs and keep the best epoch's weights."""
    return {"lr_policy": "fixed", "display": display, "num_epochs": num_epochs, "gpu": [0],
            "batchsize": batch, "batchsize_eval": batch, "snapshot": 0,
            "snapshot_prefix": "./runs/", "eval_interval": "epoch",
            "eval_metrics": ["AUC", "LogLoss"], "input_key_type": "I64",
            "early_stopping": {"metric": "AUC", "patience": patience}}


ADAM = {"type": "Adam", "update_type": "Local",
        "adam_hparam": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999,
                        "epsilon": 1e-7}}
ADAGRAD_EMB = {"type": "AdaGrad", "update_type": "Local",
               "adagrad_hparam": {"learning_rate": 0.05, "initial_accu_value": 0.0,
                                  "epsilon": 1e-7}}


def model(name, *, small: bool, dense_dim: int = 13):
    """The four models; ``small`` variants are what tests and the README's first command run.
    ``dense_dim=0``: data without dense features (the layouts leave the dense parts out)."""
    slots = 26 if not small else 8
    dim = 16 if not small else 8
    hidden = (1024, 1024) if not small else (64, 32)
    vocab_per_slot = 100_000 if not small else 2_000
    syn = {"num_samples": 400_000 if not small else 40_000,
           "eval_num_samples": 50_000 if not small else 8_000,
           "vocabulary_size": vocab_per_slot, "alpha": 1.2, "num_files": 4, "seed": 0}
    tag = f"{name}_synthetic" if small else name
    capacity = slots * vocab_per_slot
    # the full DCN/DeepFM/WDL overfit the 400k samples after ~2.5 epochs (measured): they stop
    # early on their validation set and keep the best epoch
    if small:
        sv = solver(max_iter=300, batch=512, eval_interval=300, eval_batches=16, display=50)
    elif name == "dlrm":
        sv = epoch_solver(num_epochs=6, batch=2048, display=100, patience=2)
    else:
        sv = epoch_solver(num_epochs=10, batch=2048, display=100, patience=1)
    if name == "dlrm":
        bottom = (512, 256, 64, dim) if not small else (64, dim)
        top = (512, 256, 1) if not small else (64, 32, 1)
        layers = [data_layer(tag, slots, synthetic=syn, dense_dim=dense_dim),
                  embedding("sparse_embedding1", "data1", capacity, dim)]
        layers += dlrm_layers(dense_dim, slots, dim, bottom, top)
        opt = {"type": "SGD", "update_type": "Local",
               "sgd_hparam": {"learning_rate": 0.5 if small else 0.2,
                              "warmup_steps": 50 if small else 200}}
    elif name == "dcn":
        layers = [data_layer(tag, slots, synthetic=syn, dense_dim=dense_dim),
                  embedding("sparse_embedding1", "data1", capacity, dim, optimizer=ADAGRAD_EMB)]
        layers += dcn_layers(dense_dim, slots, dim, 6 if not small else 3, hidden,
                             0.5 if not small else 0.0)
        opt = ADAM
    elif name == "deepfm":
        dim = 10 if not small else 8
        # small initial rows: with the default 1/sqrt(dim) the FM term's 325 pairwise dots
        # start as logits of std ~2, which the eval log loss never recovers from
        init = None if small else 0.01
        layers = [data_layer(tag, slots, multi_hot=True, synthetic=syn, dense_dim=dense_dim),
                  embedding("sparse_embedding1", "data1", capacity, dim, combiner=1,
                            optimizer=ADAGRAD_EMB, init_range=init),
                  embedding("sparse_embedding2", "data1", capacity, 1, combiner=1,
                            optimizer=ADAGRAD_EMB, init_range=init)]
        layers += deepfm_layers(dense_dim, slots, dim, hidden if small else (400, 400, 400),
                                0.5 if not small else 0.0)
        opt = ADAM
    elif name == "wdl":
        layers = [data_layer(tag, slots, wide=True, synthetic=syn, dense_dim=dense_dim),
                  embedding("sparse_embedding2", "wide_data", vocab_per_slot, 1,
                            optimizer=ADAGRAD_EMB),
                  embedding("sparse_embedding1", "data1", capacity, dim, optimizer=ADAGRAD_EMB)]
        layers += wdl_layers(dense_dim, slots, dim, 1, hidden, 0.5 if not small else 0.0)
        opt = ADAM
    else:
        raise ValueError(name)
    return tag, {"solver": sv, "optimizer": opt, "layers": layers}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in ("dlrm", "dcn", "deepfm", "wdl"):
        for small in (False, True):
            tag, cfg = model(name, small=small)
            with open(os.path.join(OUT, f"{tag}.json"), "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
                f.write("\n")
            print(f"configs/{tag}.json")


if __name__ == "__main__":
    main()
