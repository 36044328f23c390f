"""Static guard (no GPU needed): the CUDA sources read the device back only where
documented -- the validation of index VALUES (check_index_ranges_cuda,
check_exclude_cuda; see csrc/cuda/cuda_utils.cuh, CheckMode) -- and never call
the allocator or synchronise the device directly (issue 12).
"""

import glob
import os
import re

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda")

#: what reads device memory on the host, blocks the host, or bypasses the caching allocator
FORBIDDEN = re.compile(
    r"\.item\s*<|\.item\s*\(|\.cpu\s*\(|to\s*\(\s*at::kCPU|cudaMemcpy\s*\(|cudaMemcpyAsync|"
    r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMalloc|cudaFree|"
    r"\.tolist\s*\(")
#: the functions allowed to read back (CheckMode::kHost validation, then the error path)
ALLOWED = ("check_index_ranges_cuda", "check_exclude_cuda")


def _functions(lines):
    """(name, first line, last line) of every top-level function definition."""
    out, start, name = [], None, None
    for i, line in enumerate(lines):
        m = re.match(r"^(?:static\s+)?(?:inline\s+)?[\w:<>,\s\*&]+?\b(\w+)\s*\(", line)
        if start is None and m and not line.startswith((" ", "#", "/", "}")):
            start, name = i, m.group(1)
        if start is not None and line.startswith("}"):
            out.append((name, start, i))
            start = None
    return out


def test_device_reads_only_in_the_documented_validation():
    bad = []
    for path in sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")) + glob.glob(os.path.join(CUDA_DIR, "*.cuh"))):
        with open(path) as f:
            lines = f.read().split("\n")
        funcs = _functions(lines)
        for i, line in enumerate(lines):
            code = line.split("//")[0]
            if not FORBIDDEN.search(code):
                continue
            owner = next((n for n, a, b in funcs if a <= i <= b), None)
            if owner not in ALLOWED:
                bad.append(f"{os.path.basename(path)}:{i + 1} (in {owner}): {line.strip()}")
    assert not bad, "host sync / raw CUDA allocation outside the documented checks:\n" + "\n".join(bad)


def test_the_device_check_mode_exists():
    with open(os.path.join(CUDA_DIR, "cuda_utils.cuh")) as f:
        text = f.read()
    assert "SLIMCOMM_CUDA_CHECKS" in text and "CheckMode::kDevice" in text
