"""The house's rules, checked on the source: which package may import which, no import circles (lazy imports
inside functions count), and no module so long that a newcomer cannot read it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the folders and the package names they install as (pyproject.toml)
PACKAGES = {"dflash_core": "dflash_core", "storage": "dflash_eval.storage", "services": "dflash_eval.services",
            "tasks": "dflash_eval.tasks", "flows": "dflash_eval.flows", "cli": "dflash_eval.cli",
            "reporting": "dflash_eval.reporting", "tiny": "dflash_eval.tiny"}
LONGEST_MODULE = 600  # lines, unless the module's docstring says why (a paragraph "Why this module is long: ...")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that `name` imports anywhere in its source (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from pkg import name`: the module, else its package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def test_no_module_imports_itself_through_others():
    edges = graph()
    # a package's __init__ importing its own modules is not a circle of modules
    edges = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in edges.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


HTTP = ("requests", "urllib3", "http", "socketserver")  # HTTP servers and clients
@pytest.mark.parametrize("package, forbidden", [
    # the DFlash math and model/file handling: nothing of Prefect, the store, HTTP (nor the hub's datasets, read by
    # services/benchmark_data.py), trainers' logs or training
    ("dflash_core", ("dflash_eval", "prefect", *HTTP, "socket", "datasets", "tensorboard", "mlflow", "torch.optim")),
    ("dflash_eval.storage", ("dflash_eval.services", "dflash_eval.tasks", "dflash_eval.flows", "dflash_eval.cli",
                             "dflash_eval.reporting", "dflash_eval.tiny", "prefect", *HTTP)),
    ("dflash_eval.services", ("dflash_eval.tasks", "dflash_eval.flows", "dflash_eval.cli", "dflash_eval.reporting",
                              "dflash_eval.tiny", "prefect")),
    ("dflash_eval.tasks", ("dflash_eval.flows", "dflash_eval.cli", "dflash_eval.reporting", "dflash_eval.tiny")),
    ("dflash_eval.reporting", ("dflash_eval.flows", "dflash_eval.cli", "dflash_eval.tasks", "dflash_eval.tiny")),
    # the wiring (settings, checks, flows, deployments); the command line (cli/) may import every room, none imports it
    ("dflash_eval.flows", ("dflash_eval.cli",)),
    ("dflash_eval.tiny", ("dflash_eval.storage", "dflash_eval.services", "dflash_eval.tasks", "dflash_eval.flows",
                          "dflash_eval.cli", "dflash_eval.reporting", "prefect")),
])
def test_each_package_imports_only_what_its_job_needs(package, forbidden):
    known = modules()
    offending = []
    for name, path in known.items():
        if name != package and not name.startswith(package + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offending += [f"{name}: {t}" for t in targets if any(t == f or t.startswith(f + ".") for f in forbidden)]
    assert not offending


def test_no_module_is_too_long_to_read_without_a_reason():
    long = []
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > LONGEST_MODULE and "Why this module is long:" not in docstring:
            long.append(f"{name} ({lines} lines)")
    assert not long, "modules over ~600 lines whose docstring does not say why: " + ", ".join(long)
