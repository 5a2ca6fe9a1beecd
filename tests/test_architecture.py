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


# The folders of autotune/ are layers (ARCHITECTURE.md section 1), bottom first; a module imports only its own
# layer's and lower ones' (function-level and type-checking imports counted). What a lower layer needs of a higher one
# arrives as an argument or a protocol (backends.factory.RunHome, backends.distorted.Landscape, drivers.sweep.Listener).
LAYERS = (
    ("errors",),
    ("files",),  # every file read and written
    ("values", "search_spaces"),  # frozen values that cross module lines, their parsers; the space presets
    ("prediction",),
    ("worker",),  # one rank of a trial
    ("script", "trials"),  # a script-mode rank (shim, loops, inspection, shipping); launching and ending ranks
    ("backends",),
    ("search",),  # pruning, convergence, confirmation, the run directory, the study's storage
    ("envs",),  # the Gymnasium environment over the backends
    ("rl", "policies"),
    ("strategies",),
    ("drivers",),  # the sweep, the loop, its executors
    ("outputs",),  # report, plots, handoff, launch, tracking, script mode's first trial and outputs, sweep summary
    ("api",),  # the door: TuneSpec, tune, tune_many
    ("commands", "cli", "autotune"),  # the front ends, and the package's own lazy names
)
# Imports that go up, each with why (none today; a new one is refused until it is named here and in ARCHITECTURE.md).
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def folder_of(name: str) -> str:
    """The layer folder of a module: `autotune.values.config` -> values, `autotune.envs.x` -> envs, `autotune.api` -> api."""
    parts = name.split(".")
    return "autotune" if len(parts) == 1 else parts[1]


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the module imports behind it, every kind counted."""
    found = modules()
    known = set(found)
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in found.items():
        for target in imports(name, path, known, type_checking=True):
            a, b = folder_of(name), folder_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return edges


def upward(edges: dict[tuple[str, str], list[str]]) -> dict[str, list[str]]:
    rank = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}
    return {f"{a} -> {b}": via for (a, b), via in edges.items()
            if rank[b] > rank[a] and (a, b) not in UPWARD_EXCEPTIONS}


def test_every_folder_is_in_a_layer():
    folders = {p.name for p in (ROOT / "autotune").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top = {p.stem for p in (ROOT / "autotune").glob("*.py") if p.stem != "__init__"}
    assert folders | top | {"envs", "search_spaces", "autotune"} == {folder for layer in LAYERS for folder in layer}


def test_every_folder_imports_only_its_layer_and_below():
    assert upward(folder_edges()) == {}


def test_no_two_folders_import_each_other():
    edges = folder_edges()
    assert sorted(f"{a} <-> {b}" for a, b in edges if a < b and (b, a) in edges) == []


def test_the_layer_check_refuses_an_upward_import():
    """A value that imports a search (an upward import) is named, with the import behind it."""
    edges = {**folder_edges(), ("values", "search"): ["autotune.values.settings -> autotune.search.rundir"]}
    assert upward(edges) == {"values -> search": ["autotune.values.settings -> autotune.search.rundir"]}


TOP_LEVEL = {"__init__", "api", "cli", "files", "errors"}


def test_autotune_holds_folders_and_only_its_front_modules_at_the_top():
    """A new module goes in the folder of its layer: the top holds the door (api), the CLI, files and errors."""
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


def test_one_runner_for_every_front_end():
    """One runner (issue 42): `autotune.tune()` (so `autotune tune` and script mode) and `autotune sweep` call
    `tune_many`, which alone runs a sweep's phases; no other module opens a sweep or its tracker, and the sweep-file
    module only turns YAML into TuneSpecs (no lock, no settings written or compared, no run directory made)."""
    (runner,) = defining(RUNNER_PHASES | {"tune", "tune_many"})
    paths = modules()
    offenders = [f"{paths[name].relative_to(ROOT)}:{line}: {call}" for name in paths if name != runner
                 for line, call in called(paths[name]) if call in ("Sweep.open", "tracked", "close_sweep")]
    sweep_files = "autotune.commands.sweep_file"
    offenders += [f"{paths[sweep_files].relative_to(ROOT)}:{line}: {call}" for line, call in called(paths[sweep_files])
                  if call.rsplit(".", 1)[-1] in ("write_settings", "read_settings", "locked", "differences", "begin",
                                                 "open", "make_dir", "tune_many", "tune")]
    assert offenders == []
    assert RUNNER_PHASES | {"tune_many"} <= {call for _, call in called(paths[runner])}
    assert "tune_many" in {call for _, call in called(paths["autotune.commands.sweep"])}
    tune = next(n for n in ast.parse(paths[runner].read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "tune")
    assert "tune_many" in {c.func.id for c in ast.walk(tune) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def test_every_trial_runs_through_the_one_loop():
    """Sweeps on this machine (run_local), on a Ray cluster (run_ray, under run_on_cluster) and `surface record`
    (record_surface) run their trials through the one trial loop (drivers/loop.py's run_jobs) and its executors; the
    recording calls no backend itself."""
    paths = modules()
    for module, function in (("autotune.drivers.local", "run_local"), ("autotune.drivers.ray", "run_ray"),
                             ("autotune.drivers.recording", "record_surface")):
        body = next(n for n in ast.parse(paths[module].read_text()).body
                    if isinstance(n, ast.FunctionDef) and n.name == function)
        calls = {c.func.id for c in ast.walk(body) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert "run_jobs" in calls, function
    assert not [call for _, call in called(paths["autotune.drivers.recording"]) if call.endswith(".run")]

# A check of which mode a sweep is in (the CLI reading its own --script flag, `args.script`, is the flag's parse).
SCRIPT_CHECK = re.compile(r'''== "script"|!= "script"|(?<!args)\.script is (not )?None|\bif\s+(?!args\.)[\w.]*\.script\b''')


def test_script_mode_is_asked_through_its_interface():
    """Script mode is a mode of the runner (api.BuiltIn / api.ScriptRun: what it resolves, ships, starts, writes) and a
    capability of its backend kind (`ships`), not a string compared across the package: a spec is asked which once
    (TuneSpec.mode), a run directory's settings once (api.own_outputs)."""
    found = [f"{path.relative_to(ROOT)}:{number}" for name, path in modules().items()
             if not name.startswith("autotune.script")
             for number, line in enumerate(path.read_text().splitlines(), 1) if SCRIPT_CHECK.search(line)]
    assert len(found) <= 2 and all(place.startswith("autotune/api.py:") for place in found), found
