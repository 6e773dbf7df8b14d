"""jctr: click-through-rate recommender training and serving with huge hash embeddings on JAX.

Every jctr package that uses JAX enables 64-bit integers in it first (:mod:`jctr._x64`),
because embedding keys are 64-bit end to end; every float array jctr creates carries an explicit
dtype so nothing silently becomes float64. ``import jctr`` itself does not start JAX.

Example::

    import jctr
    trainer = jctr.Trainer.from_config("configs/dlrm_synthetic.json")
    trainer.fit()
    print(trainer.evaluate())
"""

from jctr.version import __version__ as __version__


def __getattr__(name):
    # Lazy, so that `import jctr.config` does not pull the trainer and its dependencies.
    if name == "Trainer":
        from jctr.train.trainer import Trainer

        return Trainer
    if name == "InferenceModel":
        from jctr.serving import InferenceModel

        return InferenceModel
    raise AttributeError(name)
