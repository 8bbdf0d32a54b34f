#!/usr/bin/env python3
"""Import circles between the modules of each workspace crate.

A module is one source file (`comm/group.rs` is `comm::group`; a `mod.rs` or `lib.rs` is its
directory's module). Module A depends on module B when A names an item of B through `use` or an
inline `crate::`/`super::` path; a name a `mod.rs` re-exports from its child counts as the
child's. A directory module's declarations and re-exports of its own children are structure, not
dependencies. Prints each circle (a strongly connected set of two or more modules) and exits 1
when there is one, so CI can check that none comes back.

Usage: scripts/import-graph.py [crate_dir ...]   (default: every crate of the workspace)
"""

import re
import sys
from pathlib import Path

CRATES = ["backend", "parallel", "recipes", "benches", "examples", "tests"]
PATH = re.compile(r"\b(?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*|::\{)")


def module_of(src: Path, file: Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts and parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def is_directory_module(file: Path) -> bool:
    return file.name in ("mod.rs", "lib.rs", "main.rs")


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def expand(tree: str) -> list:
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    if "{" not in tree:
        return [tree.split(" as ")[0].strip()]
    head, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    return [head + p for item in items if item.strip() for p in expand(item)]


def paths_in(text: str) -> list:
    """Every `crate::`/`super::`/`self::` path named, `use` trees expanded."""
    found = []
    for use in re.finditer(r"\buse\s+([^;]+);", text):
        found += [p for p in expand(use.group(1)) if p.split("::")[0] in ("crate", "super", "self")]
    without_uses = re.sub(r"\buse\s+[^;]+;", "", text)
    for m in re.finditer(r"\b(?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+", without_uses):
        found.append(m.group(0))
    return found


def absolute(path: str, here: tuple, directory: bool) -> tuple:
    segments = path.replace(" ", "").split("::")
    base = list(here)
    if segments[0] == "crate":
        base, segments = [], segments[1:]
    elif segments[0] == "self":
        segments = segments[1:]
    while segments and segments[0] == "super":
        # In `a/b.rs` (module a::b) `super` is `a`; in `a/mod.rs` (module a) it is the crate.
        base = base[:-1]
        segments = segments[1:]
    return tuple(base + segments)


def crate_graph(crate: Path) -> dict:
    src = crate / "src"
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f): f for f in files}
    # Names a directory module re-exports from one of its children.
    reexports = {}
    for module, file in modules.items():
        if not is_directory_module(file):
            continue
        text = strip_comments(file.read_text())
        for use in re.finditer(r"\bpub(?:\([a-z]+\))?\s+use\s+([^;]+);", text):
            for path in expand(use.group(1)):
                target = absolute(path, module, True)
                name = path.split("::")[-1].split(" as ")[-1].strip()
                reexports[module + (name,)] = target

    def resolve(target: tuple) -> tuple:
        for _ in range(8):
            if target in reexports:
                target = reexports[target]
            else:
                break
        while target and target not in modules:
            target = target[:-1]
        return target

    graph = {m: set() for m in modules}
    for module, file in modules.items():
        text = strip_comments(file.read_text())
        for path in paths_in(text):
            target = resolve(absolute(path, module, is_directory_module(file)))
            if target == module:
                continue
            if is_directory_module(file) and target[: len(module)] == module:
                continue  # a directory module's own children
            graph[module].add(target)
    return graph


def circles(graph: dict) -> list:
    """Strongly connected components of two or more modules (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
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
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def name(module: tuple) -> str:
    return "::".join(module) or "(crate root)"


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    crates = sys.argv[1:] or CRATES
    total = 0
    for crate in crates:
        graph = crate_graph(root / crate)
        edges = sum(len(targets) for targets in graph.values())
        found = circles(graph)
        total += len(found)
        print(f"{crate}: {len(graph)} modules, {edges} dependencies, {len(found)} circles")
        for component in found:
            inside = set(component)
            print("  circle:", ", ".join(name(m) for m in component))
            for m in component:
                for t in sorted(graph[m] & inside):
                    print(f"    {name(m)} -> {name(t)}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
