"""The package's structure (issue #14): no import cycle inside ``turboquant`` — every import
counts, at module level or inside a function — and no test or chapter reaching into a
private name of the package."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "turboquant"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                stem = (base + "." + node.module if node.module else base) if node.level else node.module
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph):
    colour, stack = {}, []

    def visit(m):
        colour[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if n == m.rsplit(".", 1)[0] or m.startswith(n + "."):
                continue                                    # a module importing its own package
            if colour.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in colour:
                found = visit(n)
                if found:
                    return found
        colour[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in colour:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


ROOT = PACKAGE.parent


def _sources():
    """(where, Python source) of every test module and every chapter's code cell."""
    import json
    for p in sorted((ROOT / "tests").glob("*.py")):
        yield str(p.relative_to(ROOT)), p.read_text()
    for p in sorted((ROOT / "book").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(p.read_text())["cells"]):
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
                yield f"{p.relative_to(ROOT)} cell {i}", src


def private_uses(source: str) -> list[str]:
    """Private names of the package that ``source`` reaches: ``from turboquant… import _x``
    and attribute access ``obj._x`` (dunders, a class's own ``self._x`` and IPython's display
    protocol ``_repr_*_`` excepted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("turboquant"):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("_")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and not (isinstance(node.value, ast.Name) and node.value.id == "self")
              and not (node.attr.startswith("_repr_") and node.attr.endswith("_"))):
            found.append(f".{node.attr}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")):
            found.append(f"setattr {node.args[1].value}")         # monkeypatch.setattr(m, "_x", …) by its string
    return found


def test_no_test_or_chapter_uses_a_private_name_of_the_package():
    bad = {where: uses for where, src in _sources() if where != "tests/test_structure.py"
           and (uses := private_uses(src))}
    assert not bad, bad


def test_the_private_name_finder_finds_them():
    assert sorted(private_uses("from turboquant.attention import _repeat_kv\nc._fetch(1)\nx.__class__\n"
                               "self._mine\nw._repr_png_()\nw._reprx\nmonkeypatch.setattr(m, '_d', f)\n"
                               "setattr(m, 'd', f)\nsetattr(m, '__x', f)")) == \
        ["._fetch", "._reprx", "import _repeat_kv", "setattr _d"]


def test_importing_and_plotting_change_no_global_state():
    """Importing turboquant touches nothing but the documented BLAS preload: no environment
    variables, no matplotlib settings, no reseeded random state; making a figure leaves
    rcParams as they were, and building a tiny model does not reseed mlx's generator."""
    import subprocess
    import sys
    code = """
import os, json
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
env, rc = dict(os.environ), {k: repr(v) for k, v in plt.rcParams.items()}
import turboquant
from turboquant.viz import plot_codebook
from turboquant.models import tiny_model
import mlx.core as mx
plot_codebook(16, 2)
# a reseeding builder would leave the same global state whatever the user had seeded
mx.random.seed(7); tiny_model("llama", seed=0); b = mx.random.normal((3,)).tolist()
mx.random.seed(8); tiny_model("llama", seed=0); c = mx.random.normal((3,)).tolist()
print(json.dumps({"env": sorted(set(os.environ.items()) ^ set(env.items())),
                  "rc": sorted(k for k, v in plt.rcParams.items() if repr(v) != rc[k]),
                  "reseeded": b == c}))
"""
    import json
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"env": [], "rc": [], "reseeded": False}, got


# ------------------------------------------------------------------ #27: one home per rule
DOCUMENTED_STDLIB = {("os", "_exit")}   # public despite the underscore (os module docs)


def cross_module_private_uses(package: Path = PACKAGE) -> list[str]:
    """Private names one module of the package takes from another: ``from .m import _x`` and
    ``obj._x`` where no class or function of this module defines ``_x`` (``self._x`` and
    ``cls._x`` are the object's own). mlx-lm's private state is not the package's either.
    The standard library's documented underscore names (``os._exit``) are public API."""
    trees = {p: ast.parse(p.read_text()) for p in package.rglob("*.py")}
    found = []
    for path, tree in trees.items():
        own = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name.startswith("_"):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id in ("self", "cls"):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
        where = path.relative_to(package.parent)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level:
                found += [f"{where}:{n.lineno} import {a.name}" for a in n.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) \
                    and n.attr not in own \
                    and not (isinstance(n.value, ast.Name) and (n.value.id, n.attr) in DOCUMENTED_STDLIB):
                found.append(f"{where}:{n.lineno} .{n.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    assert cross_module_private_uses() == []


def test_the_cross_module_finder_finds_them(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def _mine(self):\n        return self._x\n\n"
                              "def f(o):\n    return o._mine()\n")
    (pkg / "b.py").write_text("from .a import _hidden\n\ndef g(c):\n    return c._idx\n")
    (pkg / "c.py").write_text("import os\n\ndef h():\n    os._exit(1)\n")   # documented, not private
    assert sorted(s.split(" ", 1)[1] for s in cross_module_private_uses(pkg)) == ["._idx", "import _hidden"]   # o._mine() in a.py is its own


def _package_sources():
    for p in sorted(PACKAGE.rglob("*.py")):
        yield p.relative_to(PACKAGE.parent).as_posix(), p.read_text()


def test_each_rule_is_written_once():
    """The rules #27 gave one home are not written a second time elsewhere: the budget
    tolerance (``budget.within``), the causal mask (``attention.positions_mask``), the KV
    bytes formula (``memory.kv_bytes``), the cache directory (``paths.cache_root``)."""
    import re
    rules = {
        "turboquant/budget.py": re.compile(r"<=\s*[\w.()\[\]]+\s*\+\s*1e-9"),
        "turboquant/attention.py": re.compile(r"arange\([^)]*\)\[:,\s*None\]\s*>="),
        "turboquant/memory.py": re.compile(r"2\s*\*\s*\w*tokens\w*\s*\*\s*\w*kv_heads"),
        "turboquant/paths.py": re.compile(r"gettempdir\(\)|[\"']/tmp\b|Path\.home\(\)\s*/\s*[\"']\.cache"),
    }
    for home, pattern in rules.items():
        where = [f"{name}:{src[:m.start()].count(chr(10)) + 1}" for name, src in _package_sources()
                 for m in pattern.finditer(src) if name != home]
        assert not where, f"{pattern.pattern} belongs in {home}, also found at {where}"


def test_deprecated_names_warn_once_and_still_work(monkeypatch):
    """The renamed names of #27 keep working for one release and say what replaced them,
    once per process."""
    import warnings
    import importlib
    import sys
    import turboquant.checks as checks
    from turboquant.budget import BUDGETS
    from turboquant import bitaxon, kernels
    monkeypatch.setattr(checks, "_WARNED", set())
    calls = {
        "Budget.bits_per_coordinate": lambda: BUDGETS[0].bits_per_coordinate(64) == BUDGETS[0].bits(64),
        "bitaxon.KVCache": lambda: isinstance(bitaxon.KVCache(4), bitaxon.ExactSWACache),
        "kernels.fast_cpu_backend": lambda: kernels.fast_cpu_backend() is kernels.cpu_kernels_backend(),
    }
    import mlx.core as mx
    import turboquant as tq
    from turboquant.budget import codecs_for
    from turboquant.suite import Codecs, Config
    codec = tq.TurboQuantMSE(64, 4)
    code = codec.encode(mx.random.normal((1, 1, 5, 64), key=mx.random.key(0)))
    q = mx.random.normal((1, 1, 1, 1, 64), key=mx.random.key(1))
    unit = codec.score_table(codec.rotation.invert(q)).unit_scores(code)
    calls.update({
        "RotatedTable.query_table": lambda: mx.allclose(codec.query_table(q).scores(code), unit, atol=1e-5).item(),
        "RotatedTable.weighted_sum": lambda: codec.weighted_sum(mx.ones((1, 1, 1, 1, 5)), code).shape == (1, 1, 1, 1, 64),
        "suite.Config(...)": lambda: isinstance(Config("x", lambda d: tq.TurboQuantMSE(d, 4)), Codecs),
        "codecs_for(budget, seed)": lambda: codecs_for(BUDGETS[0], 3)[1](64).rotation.seed == 4,
    })
    for module in ("turboquant.eval", "turboquant.calibrate", "turboquant.calibrated"):
        def load(module=module):
            sys.modules.pop(module, None)
            return importlib.import_module(module).__name__ == module
        calls[module] = load
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            assert call(), name
        assert [w.category for w in first] == [checks.TurboQuantDeprecationWarning], name
        assert "deprecated: use" in str(first[0].message), name
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            assert call(), name
        assert not again, f"{name} warned twice"


def test_no_module_defines_a_function_or_class_twice():
    """A second top-level ``def`` of a name silently replaces the first (a moved function
    left behind in its old place)."""
    twice = []
    for name, src in _package_sources():
        seen = set()
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.append(f"{name}: {node.name}")
                seen.add(node.name)
    assert not twice, twice


def test_property_docstrings_do_not_read_as_types():
    """Sphinx's napoleon reads a property docstring's first line "X: y" as the type X; the
    book build (warnings as errors) then fails on "True when …: …". A first line with a
    colon must start with a type name (no spaces before the colon)."""
    bad = []
    for name, src in _package_sources():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "property"
                                                         for d in node.decorator_list):
                first = (ast.get_docstring(node) or "").split("\n")[0]
                if ": " in first and " " in first.split(": ")[0].strip():
                    bad.append(f"{name}: {node.name}: {first[:60]!r}")
    assert not bad, bad
