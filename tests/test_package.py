"""The package around the kernels: version, lazy top-level exports, metadata files.

The import-time checks run in fresh interpreters (``subprocess``), since this
process has long imported torch and the extension.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Makes `import torch` and/or `import slimcomm._C` fail in the child interpreter,
# as on a machine where torch is absent or the extension was never built.
BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = {blocked!r}

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED or name in BLOCKED:
                raise ModuleNotFoundError(f"blocked {{name}}", name=name)
            return None

    sys.meta_path.insert(0, _Blocker())
""")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _python(code, blocked=(), args=()):
    prog = BLOCKER.format(blocked=tuple(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=120)


def _pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_version_is_one_string_everywhere():
    import slimcomm
    from slimcomm import _version

    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", slimcomm.__version__)
    assert slimcomm.__version__ == _version.__version__
    with open(os.path.join(REPO, "setup.py")) as f:
        assert '"slimcomm", "_version.py"' in f.read()  # setup.py reads the same file
    assert "version" in _pyproject()["project"]["dynamic"]
    # the version compiled into the extension (it is rebuilt when _version.py changes)
    from slimcomm.info import build_info

    assert build_info()["version"] == slimcomm.__version__


def test_import_is_cheap_and_needs_neither_torch_nor_the_extension():
    r = _python("""
        import slimcomm
        print(slimcomm.__version__)
        assert "torch" not in sys.modules and "slimcomm._C" not in sys.modules, sorted(sys.modules)
        try:
            slimcomm.ops
        except ImportError as e:
            print("ops:", type(e).__name__, e)
    """, blocked=("torch",))
    assert r.returncode == 0, r.stderr
    import slimcomm

    assert r.stdout.splitlines()[0] == slimcomm.__version__
    assert "ops: ModuleNotFoundError blocked torch" in r.stdout


def test_missing_extension_raises_import_error_on_use_only():
    r = _python("""
        import slimcomm
        try:
            slimcomm.SlimDPState
        except ImportError as e:
            print("state:", e.name, "|", e)
        else:
            raise SystemExit("SlimDPState imported without the extension")
    """, blocked=("slimcomm._C",))
    assert r.returncode == 0, r.stderr
    assert "state: slimcomm._C |" in r.stdout
    assert "pip install --no-build-isolation -e ." in r.stdout


@pytest.mark.parametrize("name,module", [
    ("ops", "slimcomm.ops"), ("SlimDPState", "slimcomm.hooks"),
    ("slim_dp_hook", "slimcomm.hooks"), ("ISTTrainer", "slimcomm.ist"), ("GPTISTTrainer", "slimcomm.ist"),
    ("SlimDPFSDPState", "slimcomm.fsdp"), ("register_slim_dp_hook", "slimcomm.fsdp"),
])
def test_top_level_exports_are_the_module_objects(name, module):
    import importlib

    import slimcomm

    mod = importlib.import_module(module)
    expected = mod if module.endswith("." + name) else getattr(mod, name)
    assert getattr(slimcomm, name) is expected
    assert name in slimcomm.__all__ and name in dir(slimcomm)


def test_star_import_and_unknown_names():
    import slimcomm

    ns = {}
    exec("from slimcomm import *", ns)
    assert ns["SlimDPState"] is slimcomm.SlimDPState and ns["__version__"] == slimcomm.__version__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        slimcomm.nope  # noqa: B018
    assert not hasattr(slimcomm, "_LAZY_nope")


def test_slim_dp_optimizer_export():
    """``slimcomm.SlimDPOptimizer`` resolves once ``slimcomm.optim`` exists, says why not before."""
    import importlib.util

    import slimcomm

    if importlib.util.find_spec("slimcomm.optim") is not None:
        from slimcomm.optim import SlimDPOptimizer

        assert slimcomm.SlimDPOptimizer is SlimDPOptimizer
        assert "SlimDPOptimizer" in slimcomm.__all__
    else:
        assert "SlimDPOptimizer" not in slimcomm.__all__
        with pytest.raises(AttributeError, match="slimcomm.optim"):
            slimcomm.SlimDPOptimizer  # noqa: B018
    # the lazy table serves a module that appears later (here a stand-in)
    r = _python("""
        import types
        fake = types.ModuleType("slimcomm.optim")
        class SlimDPOptimizer: pass
        fake.SlimDPOptimizer = SlimDPOptimizer
        sys.modules["slimcomm.optim"] = fake
        import slimcomm
        assert slimcomm.SlimDPOptimizer is SlimDPOptimizer
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_info_version_needs_no_torch():
    import slimcomm

    r = _python("""
        import runpy
        sys.argv = ["slimcomm.info", "--version"]
        runpy.run_module("slimcomm.info", run_name="__main__")
    """, blocked=("torch",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"slimcomm {slimcomm.__version__}"
    r = subprocess.run([sys.executable, "-m", "slimcomm.info", "--version"], capture_output=True,
                       text=True, env=_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"slimcomm {slimcomm.__version__}", r.stderr


def test_license_changelog_and_py_typed():
    import slimcomm

    with open(os.path.join(REPO, "LICENSE")) as f:
        text = f.read()
    assert "BSD 3-Clause License" in text and "the slimcomm authors" in text
    assert _pyproject()["project"]["license"] == {"text": "BSD-3-Clause"}
    with open(os.path.join(REPO, "CHANGELOG.md")) as f:
        log = f.read()
    assert "## [Unreleased]" in log
    assert f"## [{slimcomm.__version__}]" in log
    assert os.path.isfile(os.path.join(os.path.dirname(slimcomm.__file__), "py.typed"))


def test_every_subpackage_and_py_typed_are_packaged(tmp_path):
    """setuptools' build_py (what a wheel's Python part is made of) copies every
    ``slimcomm*`` package and ``py.typed``; run on a copy so the checkout is untouched."""
    cfg = _pyproject()["tool"]["setuptools"]
    assert cfg["packages"]["find"]["include"] == ["slimcomm*"]
    assert "py.typed" in cfg["package-data"]["slimcomm"]

    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "bench", "tests", "*.so", "__pycache__", "*.egg-info", "runs"))
    (src / "slimcomm" / "_probe_subpkg").mkdir()      # a subpackage such as slimcomm/train/
    (src / "slimcomm" / "_probe_subpkg" / "__init__.py").write_text("")
    out = tmp_path / "lib"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                       cwd=src, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, SLIMCOMM_SKIP_CUDA="1"))
    assert r.returncode == 0, r.stderr
    assert (out / "slimcomm" / "py.typed").is_file()
    assert (out / "slimcomm" / "_probe_subpkg" / "__init__.py").is_file()
    packaged = {p.name for p in (out / "slimcomm").glob("*.py")}
    assert {"__init__.py", "_version.py", "ops.py", "hooks.py", "info.py"} <= packaged
    assert (out / "slimcomm" / "ist" / "trainer.py").is_file()  # a subpackage of the library
    assert (out / "slimcomm" / "train" / "__main__.py").is_file()  # the command, apart from the library
    assert (out / "slimcomm" / "train" / "workloads" / "models.py").is_file()


def test_library_never_imports_the_training_command():
    """The library (every module under slimcomm/ outside slimcomm/train/, subpackages
    included) imports nothing from slimcomm.train; relative imports are resolved."""
    import ast

    pkg = os.path.join(REPO, "slimcomm")
    bad, seen = [], 0
    for root, dirs, files in os.walk(pkg):
        rel = os.path.relpath(root, REPO).split(os.sep)        # e.g. ["slimcomm", "ist"]
        if rel[:2] == ["slimcomm", "train"] or "__pycache__" in rel:
            continue
        for name in sorted(f for f in files if f.endswith(".py")):
            seen += 1
            with open(os.path.join(root, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = rel[:len(rel) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    mods = [mod] + ([f"{mod}.{a.name}" for a in node.names] if node.level else [])
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                else:
                    continue
                if any(m == "slimcomm.train" or m.startswith("slimcomm.train.") for m in mods):
                    bad.append(f"{os.path.join(*rel, name)}:{node.lineno}")
    assert seen > 20, seen   # the walk reached the subpackages
    assert not bad, bad


def test_extension_links_the_shared_cpp_runtime():
    """The built module uses the process's one libstdc++ (NEEDED libstdc++.so.6) and
    defines none of its iostream/locale classes itself. A copy linked in statically (a
    compiler driver adding -static-libstdc++, as the GPU image's g++ wrapper does) beside
    the libstdc++ torch loads crashed every raising op there with SIGSEGV while the
    error message was formatted (bench/results/gpu/2026-12-04-h200-torch2.11-run2)."""
    import glob

    mods = glob.glob(os.path.join(REPO, "slimcomm", "_C*.so"))
    assert mods, "slimcomm/_C*.so is not built"
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    assert readelf and nm, "binutils (readelf, nm) are needed to inspect the build"
    dyn = subprocess.run([readelf, "-d", mods[0]], capture_output=True, text=True, check=True)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn.stdout)
    assert any(n.startswith("libstdc++.so") for n in needed), needed
    syms = subprocess.run([nm, "-D", "--defined-only", mods[0]], capture_output=True,
                          text=True, check=True).stdout
    # Mangled names of std::basic_ostream / std::codecvt / std::locale members.
    own = [s for s in syms.split("\n") if re.search(r"St13basic_ostream|St7codecvt|St6locale", s)]
    assert not own, own[:5]
