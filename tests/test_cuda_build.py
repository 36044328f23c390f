"""Static checks of the CUDA sources (run everywhere, no GPU or CUDA toolkit needed).

The CUDA kernels are compiled and linked by ``.ci/build_cuda.sh`` and verified
on a GPU by ``bench/gpu_check.sh`` (tests/test_ops_cuda.py). These tests catch,
on every CPU-only run, the mistakes a compile does not: an op of the schema
without a CUDA kernel (it would silently fall back to the "built without
CUDA" error), and a kernel launch whose launch error is never checked.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "csrc", "cuda")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def _cuda_sources() -> dict[str, str]:
    files = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")) + glob.glob(os.path.join(CUDA_DIR, "*.cuh")))
    assert files, "no CUDA sources in csrc/cuda"
    return {os.path.relpath(p, ROOT): _strip_comments(_read(p)) for p in files}


def _schema_ops() -> set[str]:
    src = _strip_comments(_read(os.path.join(ROOT, "csrc", "ops.cpp")))
    names = set(re.findall(r'm\.def\(\s*"([A-Za-z_][A-Za-z0-9_]*)\(', src))
    return {n for n in names if not n.startswith("_")}  # _build_info is a plain function


def test_every_op_has_a_cuda_kernel():
    ops = _schema_ops()
    assert "significance_topk" in ops and "pack" in ops, ops
    registered: dict[str, str] = {}
    for path, src in _cuda_sources().items():
        for block in re.finditer(r"TORCH_LIBRARY_IMPL\(\s*slimcomm\s*,\s*CUDA\s*,\s*m\s*\)\s*\{(.*?)\n\}",
                                 src, flags=re.S):
            for name in re.findall(r'm\.impl\(\s*"([A-Za-z_0-9]+)"', block.group(1)):
                assert name not in registered, f"{name} registered twice ({registered[name]}, {path})"
                registered[name] = path
    assert set(registered) == ops, (
        f"ops without a CUDA kernel: {sorted(ops - set(registered))}; "
        f"CUDA kernels for unknown ops: {sorted(set(registered) - ops)}")


def _launch_spans(src: str):
    """(start, end) of every `kernel<<<...>>>(...);` statement."""
    for m in re.finditer(r"<<<", src):
        # The statement ends at the ';' after the argument list's closing ')'.
        i = src.index(">>>", m.end()) + 3
        while src[i].isspace():
            i += 1
        assert src[i] == "(", src[m.start():m.start() + 80]
        depth = 0
        while True:
            c = src[i]
            depth += c == "("
            depth -= c == ")"
            i += 1
            if depth == 0:
                break
        while src[i].isspace():
            i += 1
        assert src[i] == ";", src[m.start():i + 1]
        # Start of the statement: back to the previous ';', '{', '}' or ')' of an if.
        j = m.start()
        while src[j - 1] not in ";{}" and not src[j - 5:j] == "else ":
            j -= 1
        yield j, i + 1


def test_every_kernel_launch_is_checked():
    """Each launch is followed by C10_CUDA_KERNEL_LAUNCH_CHECK() before any
    other statement (an if/else choosing between launches may share one)."""
    for path, src in _cuda_sources().items():
        spans = list(_launch_spans(src))
        if not spans:
            continue
        marked, pos = [], 0
        for a, b in spans:
            marked.append(src[pos:a])
            marked.append(" @LAUNCH; ")
            pos = b
        marked.append(src[pos:])
        text = "".join(marked)
        for m in re.finditer("@LAUNCH;", text):
            rest = text[m.end():]
            follow = re.match(r"(?:\s|else\b|if\s*\([^;{}]*\)|@LAUNCH;)*C10_CUDA_KERNEL_LAUNCH_CHECK\(\)", rest)
            assert follow, (f"{path}: a kernel launch is not followed by C10_CUDA_KERNEL_LAUNCH_CHECK(): "
                            f"...{text[max(0, m.start() - 120):m.end() + 80]}...")


def _split_top_level(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for c in args:
        depth += c in "(<{["
        depth -= c in ")>}]"
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
    return out + [cur.strip()]


def test_cuda_kernels_use_the_current_stream():
    """Launches name a stream (never the legacy default stream) and CUB calls pass one."""
    for path, src in _cuda_sources().items():
        for m in re.finditer(r"<<<([^>]*)>>>", src):
            cfg = _split_top_level(m.group(1))
            assert len(cfg) == 4 and cfg[3] not in ("0", "nullptr"), f"{path}: launch without a stream: <<<{m.group(1)}>>>"
        for m in re.finditer(r"cub::Device\w+::\w+\(([^;]*)\)\s*\)?;", src):
            assert re.search(r"\bst\b|stream", m.group(1)), f"{path}: CUB call without a stream: {m.group(0)[:120]}"
