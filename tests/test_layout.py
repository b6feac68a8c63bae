"""The package's shape, read from the source with ``ast``: the sub-packages import each other in one
direction only, the top level stays small enough to show the five modules, and no file or
function grows past what a reader can hold."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "postrl"


def unit_of(path: Path) -> str:
    """The top-level entry a source file belongs to: its sub-package, or the module itself."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imported_units(tree: ast.AST) -> set[str]:
    """Every top-level postrl entry the module imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "postrl":
                names = [f"postrl.{a.name}" for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("postrl.")}
    return found


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        unit = unit_of(path)
        graph.setdefault(unit, set()).update(imported_units(ast.parse(path.read_text())) - {unit})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between units, as the path that closes it; None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        path.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_a_function_level_import():
    a = ast.parse("def f():\n    from postrl.train.worker import PolicyTrainer\n")
    b = ast.parse("from postrl.scheduling import local\n")
    graph = {"scheduling": imported_units(a), "train": imported_units(b)}
    assert find_cycle(graph) == ["scheduling", "train", "scheduling"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_two_sub_packages_import_each_other():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def module_of(path: Path, root: Path = SRC) -> str:
    """A source file's dotted module name (a package's ``__init__`` is the package)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, modules: set[str]) -> set[str]:
    """Every postrl module the file imports, at module level, inside a function or under
    TYPE_CHECKING: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("postrl.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "postrl":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in modules else str(node.module))
    return found & modules


def file_import_graph(root: Path = SRC) -> dict[str, set[str]]:
    paths = {module_of(p, root): p for p in root.rglob("*.py")}
    return {m: imported_modules(ast.parse(p.read_text()), set(paths)) - {m} for m, p in paths.items()}


def file_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of files that import each other (directly or round a loop), each sorted: the
    strongly connected components of more than one file."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo.extend(graph.get(m, ()))
    groups = {tuple(sorted({m} | {o for o in reach[m] if m in reach.get(o, ())})) for m in graph}
    return sorted(list(g) for g in groups if len(g) > 1)


def test_file_cycles_are_seen_through_function_level_and_type_checking_imports():
    modules = {"postrl.a", "postrl.b", "postrl.c"}
    a = ast.parse("def f():\n    from postrl.b import thing\n")
    b = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from postrl import c\n")
    c = ast.parse("import postrl.a\n")
    graph = {m: imported_modules(tree, modules) for m, tree in zip(sorted(modules), (a, b, c), strict=True)}
    assert file_cycles(graph) == [["postrl.a", "postrl.b", "postrl.c"]]
    assert file_cycles({"postrl.a": {"postrl.b"}, "postrl.b": set()}) == []


def test_no_two_files_import_each_other():
    """No cycle between files either, counting imports inside functions and under TYPE_CHECKING."""
    cycles = file_cycles(file_import_graph())
    assert cycles == [], "file import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_file_cycle_check_sees_one_planted_in_the_real_tree(tmp_path):
    """The decode loop taking its engine back, as it once did (under TYPE_CHECKING): seen."""
    tree = tmp_path / "postrl"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "demo_model"))
    loop = tree / "rollout" / "native" / "decode_loop.py"
    planted = "if TYPE_CHECKING:\n    from postrl.rollout.native.engine import NativeRolloutWorker\n"
    loop.write_text(
        loop.read_text().replace("import torch\n", "from typing import TYPE_CHECKING\n\nimport torch\n", 1) + planted
    )
    found = file_cycles(file_import_graph(tree))
    assert found == [["postrl.rollout.native.decode_loop", "postrl.rollout.native.engine"]]


def files_naming(word: str, root: Path = SRC) -> set[str]:
    """The source files that name ``word`` (in code, strings or docstrings), relative to ``root``."""
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if word in p.read_text().lower().replace("-", "_")}


def test_reasoning_gym_is_named_only_by_config_data_and_reward(tmp_path):
    """One prompt source (data/prompt_source.py) decides where prompts come from: no other package
    branches on reasoning-gym. The check sees a file elsewhere that names it."""
    outside = sorted(f for f in files_naming("reasoning_gym") if f.split("/")[0] not in ("config", "data", "reward"))
    assert outside == []
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x.py").write_text("if config.data.reasoning_gym is not None:\n    pass\n")
    assert files_naming("reasoning_gym", tmp_path) == {"run/x.py"}


def test_workers_is_a_leaf_every_role_may_import():
    assert import_graph()["workers"] <= {"types"}


def test_top_level_shows_the_modules():
    entries = sorted(p.name for p in SRC.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 18, entries
    for role in ("controller", "rollout", "reward", "train", "buffer.py", "workers", "scheduling", "config"):
        assert role in entries


@pytest.mark.parametrize("limit", [500])
def test_no_file_over_the_limit(limit):
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"files over {limit} lines: {long}"


def test_no_function_over_60_lines():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_has_a_smoke_mode():
    """tests/test_benchmarks.py runs each benchmark with --smoke: one without it would go unseen."""
    scripts = [p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")]
    assert len(scripts) >= 14
    missing = [p.name for p in scripts if "add_smoke(parser)" not in p.read_text() and '"--smoke"' not in p.read_text()]
    assert not missing, f"benchmarks without --smoke: {missing}"


METRIC_NAMES = SRC / "types" / "metric_names.py"


def metric_literals(root: Path = SRC) -> list[str]:
    """Places in ``root`` that write a metric name (a value of :mod:`postrl.types.metric_names`)
    as a string instead of importing its constant. ``accuracy`` is also a reward component's flag,
    so it is looked for only as a dict key or a subscript outside ``reward/`` and ``config/``."""
    from postrl.types import metric_names

    names = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str) and "/" in v}
    found = []
    for path in root.rglob("*.py"):
        if path == METRIC_NAMES:
            continue
        tree = ast.parse(path.read_text())
        keys = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
        keys |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                flag_here = path.relative_to(root).parts[0] in ("reward", "config")
                if node.value in names or (node.value == metric_names.ACCURACY and id(node) in keys and not flag_here):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
    return found


def test_no_metric_name_is_written_as_a_string():
    assert not metric_literals(), metric_literals()


def test_the_metric_name_check_sees_a_string_name(tmp_path):
    (tmp_path / "reader.py").write_text('def kl(m):\n    return m["actor/kl"], {"accuracy": 1}\n')
    assert metric_literals(tmp_path) == ["reader.py:2 'actor/kl'", "reader.py:2 'accuracy'"]


CAP_MARGIN = 20  # a file this close to the cap is split along a seam before it reaches it

# modules that hold one function, each a seam of its own (not code moved out to dodge the size cap)
ONE_FUNCTION_MODULES = {
    "tasks/char_tokenizer.py": "the tests' and the demo's tokenizer",
    "serve/episode_routes.py": "the recorded-episode routes of the OpenAI server",
    "serve/run.py": "starting the server process",
    "train/sharding.py": "the ranks' token-balanced split",
    "reward/factory.py": "which Reward Service a reward section asks for",
    "run/plan/design_example.py": "the design's 70B example, shared by the tests and the benchmark",
    "algorithms/kl_control.py": "the adaptive KL controller's formula",
    "models/openmp_waits.py": "imported by postrl/__init__ before anything loads torch, so it imports nothing heavy",
    "models/onednn_cache.py": "imported by postrl/__init__ before torch's first matmul, so it imports nothing heavy",
    "scheduling/factory.py": "imports both schedulers, which import base.py: apart, no file cycle",
    "run/batch_sources.py": "joins the controller's batch sources to serve/'s recording server (controller/ never imports serve/)",
}


def test_no_file_close_to_the_cap_and_no_function_moved_out_alone():
    """A file within CAP_MARGIN lines of the cap is split along a seam, not trimmed by moving one
    function into a file of its own: such one-function modules are listed above with their reason."""
    near = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500 - CAP_MARGIN
    }
    assert not near, f"files within {CAP_MARGIN} lines of the cap: {near}"
    alone = set()
    for path in SRC.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        body = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if len(body) == 1 and isinstance(body[0], ast.FunctionDef):
            alone.add(str(path.relative_to(SRC)))
    assert alone == set(ONE_FUNCTION_MODULES), alone ^ set(ONE_FUNCTION_MODULES)


def test_the_controller_is_the_step_and_the_run_state():
    assert len((SRC / "controller" / "controller.py").read_text().splitlines()) < 300


ROLE_METHODS = ("train_group", "critic_worker", "preference_trainer", "reward_service", "experience_buffer")


def test_every_role_is_reached_through_a_client_made_from_its_protocol():
    """The schedulers hand each role out as ``client(handle, Protocol)`` (the Reward Service as its
    restarting wrapper around one); no hand-written client or forwarding class is left."""
    for path in (SRC / "scheduling" / name for name in ("local.py", "ray_scheduler.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ROLE_METHODS:
                returned = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
                called = {r.func.id for r in returned if isinstance(r, ast.Call) and isinstance(r.func, ast.Name)}
                assert returned and called <= {"client", "RewardServiceClient"}, (path.name, node.name, called)
    clients = sorted(
        f"{p.relative_to(SRC)}:{n.name}"
        for p in SRC.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and n.name.endswith("Client")
    )
    assert clients == ["workers/clients.py:RewardServiceClient", "workers/clients.py:RoleClient"], clients


def test_every_role_protocol_lives_in_roles():
    protocols = sorted(
        f"{p.relative_to(SRC)}:{n.name}"
        for p in SRC.rglob("*.py")
        for n in ast.parse(p.read_text()).body
        if isinstance(n, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in n.bases)
        and n.name
        in ("TrainWorker", "Critic", "RewardService", "RolloutWorker", "ScalableRolloutWorker", "ExperienceStore")
    )
    assert [p.split(":")[0] for p in protocols] == ["workers/roles.py"] * 6, protocols


ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


def architecture_rows(text: str) -> list[tuple[list[str], str]]:
    """The module table's rows: the paths named in the first cell, and the whole row."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            rows.append(([p.strip().strip("`") for p in first.split(",") if p.strip().startswith("`")], line))
    return rows


def test_the_architecture_table_is_a_map_of_what_is_there():
    """Every path the table names exists, every module of the package is covered by a row (its file
    or its folder), and each row is one line a reader takes in at a glance."""
    rows = architecture_rows(ARCHITECTURE.read_text())
    named = {p.strip() for paths, _ in rows for p in paths}
    missing = sorted(p for p in named if not (SRC / p.split(" ")[0]).exists())
    assert not missing, missing
    uncovered = sorted(
        str(rel)
        for path in SRC.rglob("*.py")
        if path.name != "__init__.py" and "demo_model" not in path.parts
        for rel in [path.relative_to(SRC)]
        if str(rel) not in named and not any(str(rel).startswith(p) for p in named if p.endswith("/"))
    )
    assert not uncovered, uncovered
    long = [line[:60] for _, line in rows if len(line) > 220]
    assert not long, long


def test_the_config_package_imports_no_torch():
    """Issue 59: config/ describes and validates; what depends on the machine (dtypes, devices,
    serial compute) is resolved outside it (models/numerics.py, controller/overlap.py)."""
    code = "import sys, postrl.config.run, postrl.config.loading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    importers = set()  # not inside a function either (RunConfig.computes_serially once asked torch there)
    for path in (SRC / "config").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                importers.add(path.name)
    assert importers == set()


def test_the_controller_imports_nothing_from_train_and_train_nothing_from_rollout():
    """Issue 59: the teachers are a role (workers/roles.Teachers) the scheduler places; the trainer's
    device checks are models/devices.py's. Neither arrow comes back."""
    graph = file_import_graph()
    arrows = {
        (a.split(".")[1], b.split(".")[1])
        for a, deps in graph.items()
        for b in deps
        if len(a.split(".")) > 2 and len(b.split(".")) > 1
    }
    assert ("controller", "train") not in arrows
    assert ("train", "rollout") not in arrows
