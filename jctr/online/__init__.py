"""Streaming training (PaddlePaddle's CPU parameter-server way): ``python -m jctr.online``
trains pass by pass over time-sliced folders (:mod:`jctr.online.runner`, with the schedule of
:mod:`jctr.online.schedule`), counting every key's show and click and shrinking the tables at
the end of each day (:mod:`jctr.online.feature_stats`)."""
