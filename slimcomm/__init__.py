"""slimcomm: communication-efficient data-parallel and subnet-parallel training.

Two published methods on top of ``torch.distributed``:

* Slim-DP (Sun et al., arXiv 1709.09393) as a DDP communication hook,
  :mod:`slimcomm.hooks` (``slimcomm.SlimDPState``, ``slimcomm.slim_dp_hook``).
* The same on FSDP2 / HSDP, compressing only the replicate-dimension gradient
  all-reduce, :mod:`slimcomm.fsdp` (``slimcomm.register_slim_dp_hook``).
* Independent subnet training, IST (Yuan et al., arXiv 1910.02120),
  :mod:`slimcomm.ist` (``slimcomm.ISTTrainer``).

The kernels behind both live in the compiled extension ``slimcomm._C`` and are
exposed as ``torch.ops.slimcomm.*`` with typed wrappers in :mod:`slimcomm.ops`
(``slimcomm.ops``).

The top-level names are imported on first use (PEP 562), so ``import slimcomm``
loads neither torch nor the compiled extension: it works, and
``slimcomm.__version__`` can be read, before the extension is built. Touching
``slimcomm.ops`` or any class then imports torch and the extension, and raises
the ``ImportError`` of a missing or broken build at that point.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import typing as _typing

from ._version import __version__

# public name -> (module, attribute in it, or None for the module itself)
_LAZY = {
    "ops": ("slimcomm.ops", None),
    "SlimDPState": ("slimcomm.hooks", "SlimDPState"),
    "slim_dp_hook": ("slimcomm.hooks", "slim_dp_hook"),
    "ISTTrainer": ("slimcomm.ist", "ISTTrainer"),
    "GPTISTTrainer": ("slimcomm.ist", "GPTISTTrainer"),
    "SlimDPOptimizer": ("slimcomm.optim", "SlimDPOptimizer"),
    "LocalAdamW": ("slimcomm.optim", "LocalAdamW"),
    "SlimDPFSDPState": ("slimcomm.fsdp", "SlimDPFSDPState"),
    "register_slim_dp_hook": ("slimcomm.fsdp", "register_slim_dp_hook"),
}

if _typing.TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from . import ops
    from .hooks import SlimDPState, slim_dp_hook
    from .ist import GPTISTTrainer, ISTTrainer


def _available(module: str) -> bool:
    """Whether ``module`` exists in this installation (a file lookup, no import)."""
    if module in _sys.modules:
        return True
    try:
        return _importlib_util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# Only the names whose module exists in this version, so `from slimcomm import *` never fails.
__all__: _typing.List[str] = ["__version__"] + [n for n, (m, _) in _LAZY.items() if _available(m)]


def _extension_hint(name: str, err: ImportError) -> ImportError:
    """``err`` itself, or, when the compiled extension is what failed, an error that says how to build it."""
    if "slimcomm._C" in _sys.modules or (err.name not in ("slimcomm", "slimcomm._C") and "_C" not in str(err)):
        return err
    return ImportError(
        f"slimcomm.{name} needs the compiled extension slimcomm._C, which is not built or does not "
        f"load ({err}); build it with `make setup` or `pip install --no-build-isolation -e .`, "
        "then check it with `python -m slimcomm.info`",
        name="slimcomm._C",
    )


def __getattr__(name: str) -> _typing.Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'slimcomm' has no attribute {name!r}") from None
    try:
        mod = _importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise _extension_hint(name, e) from e
        raise AttributeError(
            f"slimcomm.{name} lives in {module}, which this version of slimcomm "
            f"({__version__}) does not have yet"
        ) from None
    except ImportError as e:
        raise _extension_hint(name, e) from e
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> _typing.List[str]:
    return sorted({n for n in globals() if not n.startswith("_") or n.startswith("__")} | set(__all__))
