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
    return found


def test_no_test_or_chapter_uses_a_private_name_of_the_package():
    bad = {where: uses for where, src in _sources() if where != "tests/test_structure.py"
           and (uses := private_uses(src))}
    assert not bad, bad


def test_the_private_name_finder_finds_them():
    assert sorted(private_uses("from turboquant.attention import _repeat_kv\nc._fetch(1)\nx.__class__\n"
                               "self._mine\nw._repr_png_()\nw._reprx")) == ["._fetch", "._reprx", "import _repeat_kv"]


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
