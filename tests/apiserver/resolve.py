#!/usr/bin/env python3
"""Resolves the Go library closure of the test API server from Debian sid.

Reads `apt-cache dumpavail` output (from the separate sid apt configuration) on
stdin and prints `name=version` for every package needed, sorted. Only Depends
between Go library packages (golang-*-dev) and the named roots are followed:
their other dependencies (libc, pkg-config...) are for cgo or packaging and the
build here is pure Go (CGO_ENABLED=0).
"""

import re
import sys


def parse(stream):
    pkgs, provides = {}, {}
    for block in stream.read().split("\n\n"):
        fields, key = {}, None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        name = fields.get("Package")
        if not name:
            continue
        # dumpavail can list several versions; keep the highest as apt would.
        if name in pkgs and not newer(fields["Version"], pkgs[name]["Version"]):
            continue
        pkgs[name] = fields
        for prov in split_list(fields.get("Provides", "")):
            provides.setdefault(prov[0], set()).add(name)
    return pkgs, provides


def newer(a, b):
    import subprocess

    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b]).returncode == 0


def split_list(text):
    out = []
    for clause in filter(None, (c.strip() for c in text.split(","))):
        alts = []
        for alt in clause.split("|"):
            m = re.match(r"\s*([a-z0-9][a-z0-9.+-]*)", alt)
            if m:
                alts.append(m.group(1))
        if alts:
            out.append(alts)
    return out


def is_go_library(name):
    return name.startswith("golang-") and name.endswith("-dev")


def main():
    roots = sys.argv[1:]
    pkgs, provides = parse(sys.stdin)
    missing = [r for r in roots if r not in pkgs]
    if missing:
        sys.exit("sid has no package " + ", ".join(missing))
    seen, todo, skipped = set(), list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for alts in split_list(pkgs[name].get("Depends", "")):
            chosen = None
            for alt in alts:
                if alt in pkgs:
                    chosen = alt
                    break
                providers = sorted(provides.get(alt, ()))
                if providers:
                    go = [p for p in providers if is_go_library(p)]
                    chosen = (go or providers)[0]
                    break
            if chosen is None:
                skipped.add("|".join(alts))
            elif is_go_library(chosen) or chosen in roots:
                todo.append(chosen)
            else:
                skipped.add(chosen)
    for name in sorted(seen):
        print(f"{name}={pkgs[name]['Version']}")
    if skipped:
        print("not followed (not Go libraries): " + " ".join(sorted(skipped)), file=sys.stderr)


if __name__ == "__main__":
    main()
