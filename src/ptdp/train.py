"""``torchrun ... -m ptdp.train [flags]``: the training worker under torchrun (or alone, as a single
process). The worker itself is :mod:`ptdp.run.worker`.

From Python, ``ptdp.train(config)`` trains a :class:`~ptdp.config.Config` in a launched worker
(:func:`ptdp.api.train`): this module is callable, so ``ptdp.train`` is both the worker module of
``-m ptdp.train`` and that function.
"""

from __future__ import annotations

import sys
import types

from ptdp.run.worker import main


class _CallableModule(types.ModuleType):
    def __call__(self, config, **kwargs):
        from ptdp.api import train

        return train(config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
