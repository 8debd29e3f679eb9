"""The import graph stays a layered DAG: no cycles (a lazy import inside a function counts
too), and the folders import only what DESIGN.md allows."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("regatta", "elastic", "monitor", "webui", "jobs")
FORBIDDEN = {"monitor": ("elastic", "webui", "jobs", "regatta"),
             "webui": ("elastic", "jobs", "regatta"),
             "elastic": ("webui", "jobs", "regatta")}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever in the file (absolute names)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)   # from pkg import module
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {m: {d for d in imports(p) if d in modules and d != m} for m, p in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_there_is_no_import_cycle():
    edges = graph()
    assert len(edges) > 60                   # the walk really saw the code base
    assert cycle(edges) is None, " -> ".join(cycle(edges))


def test_the_cycle_finder_finds_cycles():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_layers_import_only_what_they_may():
    bad = [f"{m} imports {d}" for m, deps in graph().items() for d in deps
           if any(d.split(".")[0] == banned for banned in FORBIDDEN.get(m.split(".")[0], ()))]
    assert bad == []


def test_every_event_kind_recorded_is_defined():
    """An EventLog refuses a kind monitor/event_kinds.py does not define (at run time, in
    the middle of a recovery): every literal kind passed to ``.record`` must be there."""
    from monitor.event_kinds import KINDS
    recorded = {}
    for folder in ("elastic", "regatta", "jobs", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "record" and node.args
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    recorded.setdefault(node.args[0].value, str(path.relative_to(ROOT)))
    assert len(recorded) > 10   # the walk found the runtime's events
    assert {k: p for k, p in recorded.items() if k not in KINDS} == {}
