"""The packages form layers: no package imports, at module load, a package that imports it back
(directly or around a longer loop). Function-level imports (deliberately lazy: tensor-parallel
launch, optional dependencies) and TYPE_CHECKING imports are not load-time edges. Sub-packages
count as packages of their own (`fastgen.cpu.native` below `fastgen.cpu`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastgen"


def _node(module: str) -> str:
    """The package a module belongs to (`fastgen.cpu.native.gemm` -> `fastgen.cpu.native`); a
    package is itself, and a top-level module (`fastgen.config`) is a node of its own."""
    parts = module.split(".")
    if PACKAGE.parent.joinpath(*parts).is_dir() or len(parts) == 2:
        return module
    return ".".join(parts[:-1])


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _executed_at_load(tree.body):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("fastgen.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([base] if base else []))
            if base == "fastgen" or base.startswith("fastgen."):
                for alias in node.names:
                    candidate = PACKAGE.parent.joinpath(*f"{base}.{alias.name}".split("."))
                    is_module = candidate.with_suffix(".py").exists() or candidate.is_dir()
                    found.add(f"{base}.{alias.name}" if is_module else base)
    return found


def _executed_at_load(statements):
    """Every node a module runs when it is imported: not function bodies (lazy imports), not
    `if TYPE_CHECKING:` blocks."""
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            yield from _executed_at_load(statement.orelse)
            continue
        yield statement
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _executed_at_load(getattr(statement, field, []))


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = _node(_module_name(path))
        for target in _load_time_imports(path):
            target = _node(target)
            if target != source and target != "fastgen":
                graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {t for ts in graph.values() for t in ts}):
        if node not in index:
            visit(node)
    return found


def test_packages_import_one_way():
    graph = package_graph()
    loops = cycles(graph)
    detail = {node: sorted(graph[node] & set(loop)) for loop in loops for node in loop}
    assert not loops, f"import cycles between packages: {loops}; edges inside them: {detail}"


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_both_runners_implement_the_step_runner_interface():
    from fastgen.distributed.rank0_runner import TensorParallelRunner
    from fastgen.model_runner import ModelRunner
    from fastgen.step_runner import StepRunner

    for runner in (ModelRunner, TensorParallelRunner):
        for name in ("launch", "collect", "forget", "recover", "shutdown", "check_alive", "num_kv_blocks"):
            assert name in vars(runner), f"{runner.__name__} does not define {name} itself"
    assert not hasattr(TensorParallelRunner, "__getattr__")  # nothing forwarded implicitly
    assert StepRunner.__doc__
