"""Streaming training (PaddlePaddle's CPU parameter-server way): ``python -m jctr.online``
trains pass by pass over time-sliced folders (:mod:`jctr.online.runner`, with the schedule of
:mod:`jctr.online.schedule`); per-key show/click statistics with admission, shrink and base/delta
filters are in :mod:`jctr.online.feature_stats` (not yet wired into the runner)."""
