"""``torchrun ... -m ptdp.train [flags]``: the training worker under torchrun (or alone, as a single
process). The worker itself is :mod:`ptdp.run.worker`."""

from __future__ import annotations

import sys

from ptdp.run.worker import main

if __name__ == "__main__":
    sys.exit(main())
