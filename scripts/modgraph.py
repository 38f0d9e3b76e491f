#!/usr/bin/env python3
"""The crate's module graph, from the `crate::` paths in src/.

Usage: python3 scripts/modgraph.py [--check] [--dot]

Prints each module with the modules it uses, the same at the level of the top-level
modules and folders ("floors"), and any import cycle. With --check it exits non-zero if a
cycle exists at either level (CI runs this). With --dot it prints a Graphviz graph of the
folders instead. Every `crate::a::b` path counts, not only `use` lines; a module's own
children (a folder's `mod.rs` re-exporting its files) do not.
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return "::".join(rel) or "crate"


def strip(src):
    # Comments and strings do not import anything, but serde's `with = "crate::..."` does.
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    kept = " ".join(re.findall(r'"(crate::[a-z0-9_:]+)"', src))
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', src) + " " + kept


def main():
    files = {}
    for d, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                files[module_of(p)] = strip(open(p).read())
    mods = set(files)
    edges = {m: set() for m in mods}
    for m, src in files.items():
        paths = re.findall(r"\bcrate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", src)
        # `super::x` in module a::b is a::x (in a folder's mod.rs, module a, it is x).
        parent = m.rsplit("::", 1)[0] if "::" in m else ""
        for rel in re.findall(r"\bsuper::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", src):
            paths.append(f"{parent}::{rel}" if parent else rel)
        for path in paths:
            parts = path.split("::")
            target = None
            for k in range(len(parts), 0, -1):
                cand = "::".join(parts[:k])
                if cand in mods:
                    target = cand
                    break
            if target and target != m and not target.startswith(m + "::"):
                edges[m].add(target)

    def top(m):
        return m.split("::")[0]

    floors = {}
    for m, ts in edges.items():
        for t in ts:
            if top(t) != top(m):
                floors.setdefault(top(m), set()).add(top(t))
    for m in mods:
        floors.setdefault(top(m), set())

    def cycles(g):
        index, low, stack, on, out = {}, {}, [], set(), []
        counter = [0]

        def visit(v):
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in sorted(g.get(v, ())):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for v in sorted(g):
            if v not in index:
                visit(v)
        return out

    if "--dot" in sys.argv:
        print("digraph floors {")
        for m in sorted(floors):
            for t in sorted(floors[m]):
                print(f'  "{m}" -> "{t}";')
        print("}")
        return 0
    print("modules (each with the modules it uses):")
    for m in sorted(edges):
        print(f"  {m} -> {', '.join(sorted(edges[m])) or '-'}")
    print("\nfloors (top-level modules and folders):")
    for m in sorted(floors):
        print(f"  {m} -> {', '.join(sorted(floors[m])) or '-'}")
    bad = cycles(edges) + cycles(floors)
    print("\ncycles:", "none" if not bad else "")
    for c in bad:
        print("  " + " <-> ".join(c))
    if "--check" in sys.argv and bad:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
