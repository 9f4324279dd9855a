"""The package's layers, measured from its imports (every `import` and `from ... import` in its source, inside
functions too, except those under `if TYPE_CHECKING:`): no module imports against the layers and no import cycle.
The diagram in docs/architecture.md is drawn from the same graph; `python tests/test_layers.py` rewrites it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_diffusion"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layers: begin (python tests/test_layers.py rewrites it) -->", "<!-- layers: end -->"

# Each layer and the layers it may import from. The sampler and the estimators are independent: the likelihood
# estimators must not depend on the sampler, nor the sampler on them.
LAYERS = {
    "foundation": (),
    "models": ("foundation",),
    "sampler": ("foundation", "models"),
    "estimators": ("foundation", "models"),
    "tasks and rewards": ("foundation",),
    "model cards and Hub": ("foundation", "models", "sampler", "tasks and rewards"),
    "trainers": ("foundation", "models", "sampler", "estimators", "tasks and rewards", "model cards and Hub"),
    "evaluation": ("foundation", "models", "sampler", "estimators", "tasks and rewards", "trainers"),
    "entry points": (
        "foundation",
        "models",
        "sampler",
        "estimators",
        "tasks and rewards",
        "model cards and Hub",
        "trainers",
        "evaluation",
    ),
}
# The first part of a module's name below `trl_diffusion` -> its layer. The package root holds `__version__` and
# imports the rest lazily (by name, on attribute access), so it sits with the foundation.
MEMBERS = {
    "": "foundation",
    "validation": "foundation",
    "seeding": "foundation",
    "utils": "foundation",
    "models": "models",
    "generation": "sampler",
    "masking": "estimators",
    "likelihood": "estimators",
    "trajectory": "estimators",
    "tasks": "tasks and rewards",
    "rewards": "tasks and rewards",
    "hub": "model cards and Hub",
    "model_card": "model cards and Hub",
    "trainer": "trainers",
    "evaluation": "evaluation",
    "harness": "evaluation",
    "plotting": "evaluation",
    "scripts": "entry points",
    "cli": "entry points",
    "demo": "entry points",
    "__main__": "entry points",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    first = module.removeprefix("trl_diffusion").lstrip(".").split(".")[0]
    return MEMBERS[first]


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped |= {id(child) for statement in node.body for child in ast.walk(statement)}
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    paths = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        skipped = type_checking_nodes(tree)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:  # `from . import x` imports the submodule x when there is one
                    submodule = f"{target}.{alias.name}"
                    targets.add(submodule if submodule in paths else target)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[module] = {target for target in targets if target in paths and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def diagram(graph: dict[str, set[str]]) -> str:
    """The layers and the imports between them, as a Mermaid flowchart (an arrow: "imports from")."""
    members = {layer: sorted({name for name, owner in MEMBERS.items() if owner == layer and name}) for layer in LAYERS}
    edges = sorted(
        {(layer_of(module), layer_of(target)) for module, targets in graph.items() for target in targets}
        - {(layer, layer) for layer in LAYERS}
    )
    ids = {layer: layer.replace(" ", "_") for layer in LAYERS}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {ids[layer]}["{layer}: {", ".join(members[layer]) or "the package root"}"]' for layer in LAYERS]
    lines += [f"    {ids[source]} --> {ids[target]}" for source, target in edges]
    lines.append("```")
    return "\n".join(lines)


def test_no_import_against_the_layers():
    graph = import_graph()
    against = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) != layer_of(module) and layer_of(target) not in LAYERS[layer_of(module)]
    )
    assert against == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_and_an_import_against_the_layers_are_found():
    graph = {
        "trl_diffusion.masking": {"trl_diffusion.generation"},
        "trl_diffusion.generation": {"trl_diffusion.masking"},
    }
    assert cycles(graph) == [["trl_diffusion.generation", "trl_diffusion.masking"]]
    assert "sampler" not in LAYERS[layer_of("trl_diffusion.masking")]


def test_every_module_has_a_layer():
    assert all(layer_of(module) in LAYERS for module in import_graph())


def test_the_architecture_diagram_is_drawn_from_the_imports():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"docs/architecture.md lacks the {BEGIN} ... {END} block"
    assert text.split(BEGIN)[1].split(END)[0].strip() == diagram(import_graph())


if __name__ == "__main__":
    text = DOC.read_text()
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    DOC.write_text(f"{before}{BEGIN}\n{diagram(import_graph())}\n{END}{after}")
    print(f"rewrote the layer diagram in {DOC.relative_to(ROOT)}", file=sys.stderr)
