"""Independent subnet training (IST); see :mod:`slimcomm.ist.trainer`."""

from .trainer import *  # noqa: F401,F403
from .trainer import __all__, _build_plan, _grad_exponents  # noqa: F401
