"""picockpt's import graph, read from the source (ast): no module imports another that imports it back
(directly or around a loop), and nothing, in the package, its tests or its lessons, imports another
module's private name (what a second place needs is public)."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "picockpt"


def module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path):
    """[(module imported, [names])] of one file, relative imports resolved against its package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
    return out


def package_graph():
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names in imports_of(path):
            for dest in [f"{target}.{n}" for n in names if f"{target}.{n}" in modules] or [target]:
                # a package's own __init__ is not a dependency of the modules inside it
                if dest in modules and dest != name and not name.startswith(dest + "."):
                    edges[name].add(dest)
    return edges


def circles(edges):
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return found


def test_the_package_has_no_import_circle():
    assert circles(package_graph()) == []


def test_the_circle_finder_finds_one():  # the check above can fail
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_a_private_name_of_picockpt():
    private = []
    files = list(PACKAGE.rglob("*.py")) + list((REPO / "tests").glob("*.py")) + list((REPO / "lessons").glob("*.py"))
    for path in files:
        for target, names in imports_of(path):
            if target.split(".")[0] == "picockpt":
                private += [f"{path.relative_to(REPO)}: {target}.{n}" for n in names
                            if n.startswith("_") and not n.startswith("__")]
    assert private == []
