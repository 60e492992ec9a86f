"""The package's structure: no import cycles inside ``turboquant`` (issue #14). Every import
counts, at module level or inside a function: lower layers never import higher ones
(math ← codecs ← kernels ← attention ← caches ← models and evaluation ← faces)."""
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
