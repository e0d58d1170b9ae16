"""The shape limits of pdserve's code: lines per subpackage, long files and functions, import cycles.

Run it to see the figures; tests/unit/test_code_shape.py holds the package to the limits.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdserve"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 100
# The proxy and the API server are read most by people adding a route: their steps stay short.
MAX_SERVER_FUNCTION_LINES = 60
SERVER_MODULES = ("proxy/", "entrypoints/openai/api_server.py", "entrypoints/openai/routes.py")


def python_files() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def package_files() -> list[Path]:
    """Every file but pdserve/__init__.py, whose lazy names import nothing up front."""
    return [p for p in python_files() if p != ROOT / "__init__.py"]


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def lines_per_subpackage() -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for path in python_files():
        parts = path.relative_to(ROOT).parts
        totals[parts[0] if len(parts) > 1 else "(top)"] += len(path.read_text().splitlines())
    return dict(sorted(totals.items()))


def long_files() -> list[tuple[str, int]]:
    found = []
    for path in python_files():
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            found.append((relative(path), n))
    return found


def function_limit(name: str) -> int | None:
    if name.startswith("kernels/"):
        return None
    if any(name.startswith(m) for m in SERVER_MODULES):
        return MAX_SERVER_FUNCTION_LINES
    return MAX_FUNCTION_LINES


def long_functions() -> list[tuple[str, str, int, int]]:
    found = []
    for path in python_files():
        name = relative(path)
        limit = function_limit(name)
        if limit is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append((name, node.name, n, limit))
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Every module the file imports when it runs, deferred (function-level) imports included: a
    cycle through one is still a cycle in the design. Imports for type checkers only are not."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    targets = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.append(node.module)
    return targets


def package_imports() -> dict[str, set[str]]:
    """Edges between pdserve's subpackages; a top-level module counts as a package of its own."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in package_files():
        source = _module_name(path).split(".")[1]
        for target in _runtime_imports(ast.parse(path.read_text())):
            if target.startswith("pdserve.") and target.split(".")[1] != source:
                edges[source].add(target.split(".")[1])
    return edges


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    edges = package_imports()
    nodes = set(edges) | {d for ds in edges.values() for d in ds}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return cycles


def import_examples(cycle: list[str]) -> list[str]:
    """For each edge inside a cycle, the files that make it."""
    found = []
    for path in package_files():
        source = _module_name(path).split(".")[1]
        for target in _runtime_imports(ast.parse(path.read_text())):
            if target.startswith("pdserve.") and source in cycle:
                dest = target.split(".")[1]
                if dest in cycle and dest != source:
                    found.append(f"{source} -> {dest}: {relative(path)} imports {target}")
    return found


def main() -> int:
    totals = lines_per_subpackage()
    for package, n in totals.items():
        print(f"{package:24s} {n:6d}")
    print(f"{'total':24s} {sum(totals.values()):6d}")
    for name, n in long_files():
        print(f"file over {MAX_FILE_LINES}: {name} {n}")
    for name, func, n, limit in long_functions():
        print(f"function over {limit}: {name}:{func} {n}")
    for cycle in import_cycles():
        print("import cycle:", " <-> ".join(cycle))
        for line in import_examples(cycle):
            print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
