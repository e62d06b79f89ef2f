"""The shape of the tree: common/ is a small run-time toolbox that the trainers share, and a trainer is a file a reader
can hold in one hand.

- common/'s import graph has no cycle, and no module of common/ imports another inside a function (the way a cycle
  hides);
- it imports nothing outside itself of this project (the builders in grounds/, rlpf's code_env/, ppo_slm's stages
  and the trainers all sit above it);
- every module in it is used by at least two trainers (directly or through another module of common/), and so is
  every public name a trainer uses from it (directly, or reached through another name of common/): what one trainer
  alone needs lives beside that trainer;
- each trainer imports at most MAX_IMPORTED_NAMES names of this project, modules counted as one name each, so that
  its calls say which file to open (`rollout.generate(...)`); the standard library and torch are not counted;
- common/ stays within its budget, counted in characters (a line budget rewards packing lines).
"""

import ast
import os

import pytest
from conftest import ROOT

TRAINERS = ["grpo", "oc_grpo", "rloo_sec", "adakp", "mada_rl", "direct_opd", "rlpf", "ppo_slm"]
LOCAL_TOP = {"common", "grounds", "code_env", *{f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}}
COMMON_CHAR_BUDGET = 233_000
"""characters of common/*.py: 181,000 in 3,250 lines at issue 57's layout; 197,400 in 3,530 with reasoning_gym.py and
manifest.py; 202,800 with issue 58's resume from args.json, cut warning, progress bars off a terminal and second
Ctrl-C; 231,500 with memory_plan.py (issue 64's --plan-memory for every trainer: one rule written once for eight
trainers, which must import no torch, so it cannot lean on the rest of common/)"""
MAX_IMPORTED_NAMES = 12


def imports(path: str) -> tuple[set, set]:
    """(module-level, function-level) project modules imported by the file at `path`, as dotted names."""
    tree = ast.parse(open(path).read())
    top, local = set(), set()

    def names(node):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "common":  # `from common import x` names a module
                return {f"common.{a.name}" for a in node.names}
            return {node.module}
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        return set()

    for node in tree.body:
        top |= names(node)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                local |= names(inner)
    keep = lambda s: {m for m in s if m.split(".")[0] in LOCAL_TOP}  # noqa: E731
    return keep(top), keep(local)


def common_modules() -> list[str]:
    return sorted(f"common.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "common"))
                  if f.endswith(".py") and f != "__init__.py")


def module_file(name: str) -> str:
    return os.path.join(ROOT, *name.split(".")) + ".py"


def test_common_has_no_import_cycle_and_no_function_local_imports_of_its_own_modules():
    graph = {}
    for m in common_modules():
        top, local = imports(module_file(m))
        assert not {x for x in local if x.startswith("common")}, f"{m} imports {local} inside a function"
        graph[m] = {x for x in top if x.startswith("common.")}
    done, on_path = set(), []

    def visit(m):
        assert m not in on_path, "import cycle: " + " -> ".join(on_path[on_path.index(m):] + [m])
        if m in done:
            return
        on_path.append(m)
        for n in graph.get(m, ()):
            visit(n)
        on_path.pop()
        done.add(m)

    for m in graph:
        visit(m)


def test_common_imports_nothing_of_the_project_outside_itself():
    for m in common_modules():
        top, local = imports(module_file(m))
        outside = {x for x in top | local if not x.startswith("common")}
        assert not outside, f"{m} imports {outside}: the builders, environments and trainers sit above common/"


def test_every_module_of_common_serves_at_least_two_trainers():
    def closure(module_names):
        seen, todo = set(), list(module_names)
        while todo:
            m = todo.pop()
            if m in seen or not m.startswith("common."):
                continue
            seen.add(m)
            todo += imports(module_file(m))[0]
        return seen

    users = {m: [] for m in common_modules()}
    for t in TRAINERS:
        top, local = imports(os.path.join(ROOT, f"{t}.py"))
        for m in closure(top | local):
            users[m].append(t)
    alone = {m: u for m, u in users.items() if len(u) < 2}
    assert not alone, f"modules of common/ that fewer than two trainers use (move them beside their trainer): {alone}"


def test_common_stays_within_its_character_budget():
    chars = sum(len(open(module_file(m)).read()) for m in [*common_modules(), "common.__init__"])
    assert chars <= COMMON_CHAR_BUDGET, f"common/ has {chars:,} characters, over its budget of {COMMON_CHAR_BUDGET:,}"


def imported_names(path: str) -> dict:
    """{name the file binds: dotted module it comes from (for a module, itself)} of every import of this project in
    the file at `path`, at module level or inside a function (a name imported twice counts once)."""
    found = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                found[a.asname or a.name] = node.module if node.module != "common" else f"common.{a.name}"
        elif isinstance(node, ast.Import):
            found.update({a.asname or a.name: a.name for a in node.names})
    return {k: v for k, v in found.items() if v.split(".")[0] in LOCAL_TOP}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_trainer_imports_at_most_twelve_names_of_the_project(trainer):
    names = imported_names(os.path.join(ROOT, f"{trainer}.py"))
    assert len(names) <= MAX_IMPORTED_NAMES, (
        f"{trainer}.py imports {len(names)} names of this project (at most {MAX_IMPORTED_NAMES}): {sorted(names)}; "
        "import modules (from common import rollout) and call rollout.generate(...)")


def common_name_graph() -> dict:
    """{(module, name): the (module, name) pairs of common/ its code refers to} for every name defined at the top level
    of a module of common/ (functions, classes, constants): bare names of its own module, names imported from
    another module of common/, and `module.name` of an imported module of common/."""
    graph = {}
    for m in common_modules():
        tree = ast.parse(open(module_file(m)).read())
        imported = {}  # name bound here -> (module, name), or (module, None) for a module
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("common"):
                for a in node.names:
                    imported[a.asname or a.name] = ((f"common.{a.name}", None) if node.module == "common"
                                                    else (node.module, a.name))
        defs = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):
                        defs[target.id] = node
        for name, node in defs.items():
            refs = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id != name and sub.id in defs:
                    refs.add((m, sub.id))
                elif isinstance(sub, ast.Name) and imported.get(sub.id, (None, None))[1]:
                    refs.add(imported[sub.id])
                elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in imported
                      and imported[sub.value.id][1] is None):
                    refs.add((imported[sub.value.id][0], sub.attr))
            graph[(m, name)] = refs
    return graph


def trainer_files(trainer: str) -> list[str]:
    """The trainer's file and the project files beside it that it imports, in turn (ppo_slm_stages.py,
    mada_rl_agents.py, rlpf's code_env/): not common/, not the embedded grounds/."""
    files, todo = [], [os.path.join(ROOT, f"{trainer}.py")]
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.append(path)
        for module in set(imported_names(path).values()):
            if module.split(".")[0] not in ("common", "grounds"):
                candidate = module_file(module)
                todo += [candidate] if os.path.isfile(candidate) else []
    return files


def common_names_used(path: str) -> set:
    """(module, name) of every name of common/ the file at `path` uses: imported by name, or `module.name` of an
    imported module of common/."""
    tree, used = ast.parse(open(path).read()), set()
    modules = {k: v for k, v in imported_names(path).items() if v.startswith("common.") and
               os.path.isfile(module_file(v)) and k == v.rsplit(".", 1)[1]}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            used |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.add((modules[node.value.id], node.attr))
    return used


def test_every_public_name_a_trainer_uses_from_common_serves_at_least_two_trainers():
    graph, users = common_name_graph(), {}
    for t in TRAINERS:
        seen, todo = set(), [u for f in trainer_files(t) for u in common_names_used(f)]
        while todo:  # what the trainer uses, and what that uses in turn inside common/
            key = todo.pop()
            if key not in seen and key in graph:
                seen.add(key)
                todo += graph[key]
        for key in seen:
            users.setdefault(key, set()).add(t)
    alone = {f"{m}.{n}": sorted(u) for (m, n), u in users.items() if len(u) < 2 and not n.startswith("_")}
    assert not alone, f"names of common/ that fewer than two trainers use (move them beside their trainer): {alone}"
