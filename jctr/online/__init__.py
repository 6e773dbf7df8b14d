"""Streaming training (PaddlePaddle's CPU parameter-server way), built up in parts: the
time-sliced data schedule (:mod:`jctr.online.schedule`) and the per-key show/click statistics
with admission, shrink and base/delta filters (:mod:`jctr.online.feature_stats`). The
``python -m jctr.online`` runner that trains pass by pass with them is not built yet."""
