"""The package's shape: no import cycle (function-level imports included, where cycles hide), no module of
the library imports the CLI (`autotune.commands`, `autotune.cli`), and the bottom layers import nothing above
them."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autotune": ROOT / "autotune", "autotune.envs": ROOT / "envs", "autotune.search_spaces": ROOT / "search_spaces"}
CLI = ("autotune.commands", "autotune.cli")


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str], *, type_checking: bool = False) -> set[str]:
    """Every autotune module `name` imports, at any depth of its code (a package import counts as its
    __init__); `if TYPE_CHECKING:` blocks are left out (they never run) unless `type_checking`."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def without_parents(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A module importing its own package's __init__ is how Python imports a submodule, not a cycle."""
    return {n: {t for t in targets if not n.startswith(t + ".")} for n, targets in edges.items()}


def test_the_package_has_no_import_cycle():
    found = cycle(without_parents(graph()))
    assert found is None, " -> ".join(found)


def test_no_library_module_imports_the_cli():
    offenders = {name: sorted(t for t in targets if t.startswith(CLI))
                 for name, targets in graph().items() if not name.startswith(CLI)}
    assert {n: t for n, t in offenders.items() if t} == {}


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_counting_type_checking_imports():
    found = modules()
    known = set(found)
    # A circle drawn only for the type checker is still one a reader has to untangle (issue 26).
    edges = {name: imports(name, path, known, type_checking=True) for name, path in found.items()}
    cycle_found = cycle(without_parents(edges))
    assert cycle_found is None, " -> ".join(cycle_found)


# The folders of autotune/ are layers (ARCHITECTURE.md section 1). The two at the bottom are pure: a value or
# a prediction never reaches up to a trial, a search, an output or a front end (type-checking imports counted).
# worker.imports is a leaf (DeepSpeed imported without MLflow) that dsconfig's DeepSpeed parser check needs too.
BASE = ("autotune.errors", "autotune.values", "autotune.files", "autotune.search_spaces", "autotune.worker.imports")
LOWER = {"autotune.values": BASE, "autotune.prediction": (*BASE, "autotune.prediction")}
TOP_LEVEL = {"__init__", "api", "cli", "files", "errors"}


def test_values_and_predictions_import_no_higher_layer():
    found = modules()
    known = set(found)
    offenders = {}
    for name, path in found.items():
        layer = next((layer for layer in LOWER if name == layer or name.startswith(layer + ".")), None)
        if layer is None:
            continue
        above = sorted(t for t in imports(name, path, known, type_checking=True)
                       if t != "autotune" and not t.startswith(LOWER[layer]))
        if above:
            offenders[name] = above
    assert offenders == {}


def test_autotune_holds_folders_and_only_its_front_modules_at_the_top():
    """A new module goes in the folder of its layer: the top holds the door (api), the CLI and files."""
    assert {p.stem for p in (ROOT / "autotune").glob("*.py")} == TOP_LEVEL
    assert {"values", "prediction", "trials", "search", "outputs"} <= {p.name for p in (ROOT / "autotune").iterdir()}


BUDGET_DEFAULT = re.compile(r"\bor\s+[\w.()]*\bmemory_bytes\b|\bmemory_bytes\s+if\s+[\w.]+\s+is\s+None\b")


def test_the_budget_default_is_decided_in_one_place():
    """"The budget is the hardware's memory unless one is chosen" is autotune.values.settings.memory_budget's alone."""
    offenders = [f"{path.relative_to(ROOT)}:{number}" for name, path in modules().items()
                 if name != "autotune.values.settings"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if BUDGET_DEFAULT.search(line)]
    assert offenders == []
    settings = (ROOT / "autotune" / "values" / "settings.py").read_text()
    assert len(BUDGET_DEFAULT.findall(settings)) == 1


BACKENDS_FOLDER = ROOT / "autotune" / "backends"
FACTORY = BACKENDS_FOLDER / "factory.py"


def backend_classes() -> set[str]:
    """The backend classes `autotune/backends/` defines (the `Backend` protocol aside)."""
    names = set()
    for path in BACKENDS_FOLDER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Backend") and node.name != "Backend":
                names.add(node.name)
    return names


def test_backends_are_constructed_only_in_the_backends_folder():
    """Backends only through the factory (issue 26): outside `autotune/backends/`, no module calls a backend
    class; it calls `make_backend` or the factory's constructor of the kind."""
    classes = backend_classes()
    assert {"DeepSpeedBackend", "ScriptBackend", "SimulatedBackend", "ReplayBackend", "DistortedBackend"} <= classes
    offenders = []
    for path in modules().values():
        if BACKENDS_FOLDER in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if called in classes:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {called}(...)")
    assert offenders == []


def test_no_module_lists_backend_names_beside_the_registry():
    """Which kinds a front end offers is read from the registry's flags (`backend_names`): no tuple, list or
    set of two or more backend names is written outside the factory."""
    from autotune.backends.factory import backend_names

    names = set(backend_names(sweep=None))
    assert {"deepspeed", "simulated", "replay", "script"} <= names
    offenders = []
    for path in modules().values():
        if path == FACTORY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
                values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if len(values) == len(node.elts) and all(v in names for v in values):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {values}")
    assert offenders == []


def test_the_registry_flags_give_each_front_end_its_kinds():
    from autotune.backends.factory import backend_names
    from autotune.commands.surface import BACKENDS as SURFACE
    from autotune.envs.config import BACKENDS as ENV
    from autotune.rl.train import BACKENDS as TRAIN

    assert backend_names()[:3] == ("deepspeed", "simulated", "replay") and "script" not in backend_names()
    assert SURFACE == ("deepspeed", "simulated")
    assert TRAIN == ("simulated", "replay")
    assert set(ENV) == {"simulated", "replay", "deepspeed"}


RUNNER_PHASES = {"plan_run", "hold", "open_sweep", "close_run"}


def called(path: Path) -> list[tuple[int, str]]:
    """Each call's name in the module, with its receiver where it is a name (`Sweep.open`, `run.locked`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.append((node.lineno, func.id))
            elif isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else ""
                found.append((node.lineno, f"{owner}.{func.attr}" if owner else f".{func.attr}"))
    return found


def defining(names: set[str]) -> list[str]:
    """The modules that define every function of `names` at their top level."""
    return [name for name, path in modules().items()
            if names <= {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}]


def test_one_sweep_runner_opens_run_directories():
    """One sweep runner (issue 26): `autotune tune`, `autotune.tune()` and `autotune sweep` (once per workload) go
    through its phases; no other module opens a sweep or its tracker, and the sweep-file module neither takes
    a run directory's lock nor writes or compares its settings."""
    (runner,) = defining(RUNNER_PHASES | {"tune"})
    (sweep_files,) = defining({"load_sweep", "run_sweep"})
    paths = modules()
    offenders = [f"{paths[name].relative_to(ROOT)}:{line}: {call}" for name in paths if name != runner
                 for line, call in called(paths[name]) if call in ("Sweep.open", "tracked", "close_sweep")]
    offenders += [f"{paths[sweep_files].relative_to(ROOT)}:{line}: {call}" for line, call in called(paths[sweep_files])
                  if call.rsplit(".", 1)[-1] in ("write_settings", "read_settings", "locked", "differences", "begin",
                                                 "open", "make_dir")]
    assert offenders == []
    uses = {call.rsplit(".", 1)[-1] for _, call in called(paths[sweep_files])}
    assert RUNNER_PHASES <= uses  # each workload through every phase
