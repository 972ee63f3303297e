"""The package's imports flow one way: no cycles, kernels import nothing from the layers above
them (nor the MoE maths of quantdispatch.moe), each layout folder under kernels/ imports only
kernels/common/ and itself, and no module grows past the house limit.

Imports are read from the source (ast), module level and inside functions alike; blocks under
``if TYPE_CHECKING:`` are skipped (they never run). ``from package import name`` counts as an
import of the submodule ``package.name`` where one exists, else of the package itself; the
package ``__init__`` Python runs on the way to a submodule is not counted (a package that
re-exports its submodules would otherwise be a cycle with each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "quantdispatch"

#: What kernels/ must never import: the layers above it.
KERNELS_MUST_NOT_IMPORT = (
    "moe",
    "backends",
    "layers",
    "api",
    "resolver",
    "settings",
    "cli",
    "integrations",
)
#: The layout folders under kernels/: each imports only kernels/common/, the regime table at the
#: kernels root (data every layout's plan reads) and itself.
KERNEL_LAYOUTS = ("checkpoint_layout", "mma_layout", "native")
KERNELS_SHARED = ("kernels.common", "kernels.regimes")
#: What backends/ must never import.
BACKENDS_MUST_NOT_IMPORT = ("layers", "api", "cli", "integrations")

MAX_LINES = 500
#: Modules allowed past MAX_LINES, each with its reason (none today).
LONG_MODULES: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom that can run (not under ``if TYPE_CHECKING:``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _target(name: str) -> str | None:
    """The package module ``name`` resolves to (its longest known prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # a submodule where ``base.name`` is one, else the module ``base`` itself
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _target(name)
                if target is not None and target != module:
                    found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(_one_cycle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle inside ``component``, from its first module back to it (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def test_the_walk_sees_function_level_imports_and_skips_type_checking():
    assert "quantdispatch.backends.triton.run" in GRAPH["quantdispatch.backends.triton"]
    assert "quantdispatch.device" not in GRAPH["quantdispatch.backends.base"]  # TYPE_CHECKING


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _offenders(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    banned = tuple(f"{PACKAGE}.{name}" for name in forbidden)
    return [
        f"{module} imports {target}"
        for module, targets in sorted(GRAPH.items())
        if module == f"{PACKAGE}.{layer}" or module.startswith(f"{PACKAGE}.{layer}.")
        for target in sorted(targets)
        if any(target == b or target.startswith(b + ".") for b in banned)
    ]


def test_kernels_import_nothing_from_the_layers_above():
    offenders = _offenders("kernels", KERNELS_MUST_NOT_IMPORT)
    assert not offenders, "\n".join(offenders)


def _kernel_offenders(layer: str, allowed: tuple[str, ...]) -> list[str]:
    """Imports of ``kernels.<layer>`` modules into quantdispatch.kernels outside ``allowed``."""
    own = f"{PACKAGE}.kernels.{layer}"
    ok = (*(f"{PACKAGE}.{name}" for name in allowed), own)
    return [
        f"{module} imports {target}"
        for module, targets in sorted(GRAPH.items())
        if module == own or module.startswith(own + ".")
        for target in sorted(targets)
        if target.startswith(f"{PACKAGE}.kernels.")
        and not any(target == a or target.startswith(a + ".") for a in ok)
    ]


def test_each_kernel_layout_imports_only_common_and_itself():
    offenders = [o for layout in KERNEL_LAYOUTS for o in _kernel_offenders(layout, KERNELS_SHARED)]
    assert not offenders, "\n".join(offenders)


def test_kernels_common_imports_no_layout():
    offenders = _kernel_offenders("common", ("kernels.regimes",))
    assert not offenders, "\n".join(offenders)


def test_the_layout_rule_sees_a_cross_layout_import():
    graph = dict(GRAPH)
    bad = f"{PACKAGE}.kernels.mma_layout.moe_gemm"
    GRAPH[bad] = GRAPH[bad] | {f"{PACKAGE}.kernels.checkpoint_layout.moe_gemm"}
    try:
        assert _kernel_offenders("mma_layout", KERNELS_SHARED)
    finally:
        GRAPH.clear()
        GRAPH.update(graph)


def test_backends_import_no_layers_api_or_cli():
    offenders = _offenders("backends", BACKENDS_MUST_NOT_IMPORT)
    assert not offenders, "\n".join(offenders)


def test_no_module_is_longer_than_the_house_limit():
    long = {
        module: n
        for module, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES and module not in LONG_MODULES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"
    stale = [m for m in LONG_MODULES if m not in MODULES]
    assert not stale, f"LONG_MODULES names modules that no longer exist: {stale}"


def _module_level(module: str) -> set[str]:
    """Every name imported at module level (not in functions, not under TYPE_CHECKING)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            stack.extend(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend([*node.body, *node.orelse, *node.finalbody])
            for handler in node.handlers:
                stack.extend(handler.body)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _loads_at_import(module: str) -> set[str]:
    """What importing ``module`` imports (module level, transitively through the package)."""
    seen, todo, external = {module}, [module], set()
    while todo:
        for name in _module_level(todo.pop()):
            target = _target(name) if name.startswith(PACKAGE + ".") else None
            if target is None:
                external.add(name.split(".")[0])
            elif target not in seen:
                seen.add(target)
                todo.append(target)
    return external


#: Plan and table modules doctor reads without triton installed.
NO_TRITON = (
    "quantdispatch.kernels.regimes",
    "quantdispatch.kernels.common.configs",
    "quantdispatch.kernels.common.device_facts",
    "quantdispatch.kernels.checkpoint_layout.moe_plan",
    "quantdispatch.kernels.common.moe_activations",
    "quantdispatch.kernels.common.moe_finalize",
    "quantdispatch.kernels.common.moe_plan",
    "quantdispatch.kernels.mma_layout.moe_plan",
    "quantdispatch.kernels.mma_layout.layout",
    "quantdispatch.kernels.mma_layout.gemm_tiles",
    "quantdispatch.backends.triton.facts",
    "quantdispatch.backends.triton.dispatch",
    "quantdispatch.backends.triton.prepare",
)


def test_plans_and_the_regime_table_import_no_triton():
    loads = {module: _loads_at_import(module) for module in NO_TRITON}
    assert not [m for m, ext in loads.items() if "triton" in ext], loads
    assert not _loads_at_import("quantdispatch.kernels.regimes") - {
        "__future__",
        "dataclasses",
        "enum",
        "typing",
    }
