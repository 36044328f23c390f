"""``python -m slimcomm.train``: runs the training command (:func:`slimcomm.train.loop.main`)."""

import sys

from .loop import main

if __name__ == "__main__":
    sys.exit(main())
