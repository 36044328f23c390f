"""``python -m slimcomm.info``: what this slimcomm build contains.

Prints the slimcomm version, the torch version the extension was compiled
against and the one running now, and which backends have compiled kernels
(CPU always; CUDA with its target architectures when built with CUDA). Warns
when the build and the running torch disagree, or when a GPU is visible but
the build has no CUDA kernels.

``python -m slimcomm.info --version`` prints only the slimcomm version (it
imports neither torch nor the extension, so it works before a build).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Optional, Sequence

from ._version import __version__


def build_info() -> dict:
    """The build record compiled into ``slimcomm._C`` plus the running torch.

    Returns:
        dict with keys ``version``, ``torch`` (built against), ``torch_runtime``,
        ``cpu`` (bool), ``cuda`` (bool), ``cuda_archs`` (str, e.g. ``"8.0;9.0+PTX"``),
        ``cuda_available`` (bool, a GPU is usable now).

    Raises:
        ImportError: the compiled extension cannot be loaded (not built, or
            built against an incompatible torch).
    """
    import torch

    from . import _C  # noqa: F401  (registers the ops)

    info = json.loads(torch.ops.slimcomm._build_info())
    info["torch_runtime"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    return info


def problems(info: dict) -> list[str]:
    """Human-readable mismatches between the build and the runtime."""
    out = []
    if info["torch"] != info["torch_runtime"]:
        out.append(
            f"slimcomm was built against torch {info['torch']} but torch {info['torch_runtime']} "
            "is running; rebuild with `pip install --no-build-isolation -e .`"
        )
    if info["cuda_available"] and not info["cuda"]:
        out.append("a CUDA device is available but this build has no CUDA kernels")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimcomm.info", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"slimcomm {__version__}")
    p.parse_args(argv)
    try:
        info = build_info()
    except ImportError as e:  # pragma: no cover - exercised only on broken installs
        print(f"slimcomm: the compiled extension could not be loaded: {e}", file=sys.stderr)
        return 1
    cuda = f"yes (archs {info['cuda_archs']})" if info["cuda"] else "no"
    print(f"slimcomm        {info['version']}")
    print(f"torch (built)   {info['torch']}")
    print(f"torch (running) {info['torch_runtime']}")
    print("kernels         CPU: yes, CUDA: " + cuda)
    print(f"CUDA device     {'available' if info['cuda_available'] else 'not available'}")
    for p in problems(info):
        warnings.warn(p, RuntimeWarning, stacklevel=1)
        print(f"WARNING: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
