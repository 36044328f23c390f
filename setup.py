"""Build script for the slimcomm C++/CUDA extension.

CPU kernels are always built. CUDA kernels (csrc/cuda/*.cu) are built when the
installed torch is a CUDA build and a CUDA toolkit is found (``CUDA_HOME``),
or when ``SLIMCOMM_FORCE_CUDA=1``; ``SLIMCOMM_SKIP_CUDA=1`` skips them. The
decision never depends on ``torch.cuda.is_available()``, so the CUDA sources
compile on machines without a GPU. ``TORCH_CUDA_ARCH_LIST`` overrides the
default architectures (sm_80, sm_90 + PTX); ``MAX_JOBS`` and ``NVCC_THREADS``
are respected.

Install with ``pip install --no-build-isolation -e .`` against the installed torch.
"""

import glob
import os
import re

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def read_version():
    with open(os.path.join(ROOT, "slimcomm", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def want_cuda():
    if os.environ.get("SLIMCOMM_SKIP_CUDA", "0") == "1":
        return False
    if os.environ.get("SLIMCOMM_FORCE_CUDA", "0") == "1":
        return True
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def cuda_archs():
    # torch's builder turns TORCH_CUDA_ARCH_LIST into -gencode flags.
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    return os.environ["TORCH_CUDA_ARCH_LIST"]


VERSION = read_version()
with_cuda = want_cuda()
sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
define_macros = [
    ("SLIMCOMM_VERSION", f'"{VERSION}"'),
    ("SLIMCOMM_TORCH_VERSION", f'"{torch.__version__}"'),
    ("Py_LIMITED_API", "0x03090000"),
]
# No -std flag: torch picks the standard its headers need (C++17 or C++20).
# -ffp-contract=off: no fused multiply-adds, so the kernels round like the separate ATen
# ops they replace (bit-identity; e.g. the codec's v - level * scale) on every target.
# -fno-trapping-math: lets GCC vectorise loops with float selects (the codec's clamps);
# it only drops the assumption that FP exceptions trap, values are unchanged.
cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
             "-fdiagnostics-color=always"]
extra_compile_args = {"cxx": cxx_flags}
# Link the C++ runtime dynamically even where the compiler driver links it
# statically by default (seen on a GPU image whose g++ wrapper adds
# -static-libstdc++): a private libstdc++ inside the module beside the one torch
# loads crashes the first time an error message is formatted (a TORCH_CHECK ->
# std::ostream in the wrong copy: SIGSEGV instead of a RuntimeError). Listed
# before the driver's own libraries, the shared -lstdc++ resolves every symbol,
# so a static libstdc++.a added later contributes nothing.
DYNAMIC_LIBSTDCXX = ["-Wl,--push-state,--no-as-needed,-Bdynamic", "-lstdc++", "-Wl,--pop-state"]
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros += [("SLIMCOMM_WITH_CUDA", None), ("SLIMCOMM_CUDA_ARCHS", f'"{cuda_archs()}"')]
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    if os.environ.get("NVCC_THREADS"):
        nvcc_flags.append(f"--threads={os.environ['NVCC_THREADS']}")
    extra_compile_args["nvcc"] = nvcc_flags
    Extension = cpp_extension.CUDAExtension
else:
    Extension = cpp_extension.CppExtension

setup(
    version=VERSION,
    ext_modules=[
        Extension(
            name="slimcomm._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"] + DYNAMIC_LIBSTDCXX,
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
