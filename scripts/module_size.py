#!/usr/bin/env python3
"""Where a Wasm module's bytes go: its sections, and its code per crate and per
function, named from the module's name section. The shipped module has none
(`strip = "symbols"`); build one with the names kept (docs/benchmarks.md, "The
module's fixed cost"):

    cargo build -p staleguard-filter --target wasm32-wasip1 --profile wasm-release \
      --config 'profile.wasm-release.strip="debuginfo"'
    scripts/module_size.py target/wasm32-wasip1/wasm-release/staleguard_filter.wasm [TOP]

Only the standard library: no wasm tooling needed."""
import re
import sys
from collections import Counter


def leb(buf, i):
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return out, i


def demangle(name):
    """Rust legacy symbols (_ZN..E) to a::b::c, hash dropped."""
    m = re.match(r"_ZN(.*)E$", name)
    if not m:
        return name
    s, parts, i = m.group(1), [], 0
    while i < len(s) and s[i].isdigit():
        j = i
        while s[j].isdigit():
            j += 1
        n = int(s[i:j])
        parts.append(s[j:j + n])
        i = j + n
    if parts and re.fullmatch(r"h[0-9a-f]{16}", parts[-1]):
        parts.pop()
    text = "::".join(parts)
    for a, b in [("$LT$", "<"), ("$GT$", ">"), ("$u20$", " "), ("$RF$", "&"), ("$C$", ","),
                 ("$BP$", "*"), ("$u7b$", "{"), ("$u7d$", "}"), ("$u5b$", "["), ("$u5d$", "]"),
                 ("..", "::"), ("$u27$", "'")]:
        text = text.replace(a, b)
    return text


def crate_of(name):
    """The first crate a (demangled) name mentions: `<T as Trait>::f` counts
    for T's crate; a v0 symbol (_R...) for the first crate it names."""
    v0 = re.match(r"_R\w*?C(?:s\w+?_)?(\d+)", name)
    if v0:
        rest = name[v0.end():]
        return rest[: int(v0.group(1))]
    n = name.lstrip("_<&* ")
    n = re.sub(r"^(impl |dyn |mut )+", "", n)
    return re.split(r"::|[<> ,]", n, maxsplit=1)[0] or name


def main(path, top=40):
    buf = open(path, "rb").read()
    i, sections, imported, bodies, names = 8, Counter(), 0, [], {}
    while i < len(buf):
        sid = buf[i]
        size, j = leb(buf, i + 1)
        end = j + size
        if sid == 0:
            nlen, k = leb(buf, j)
            cname = buf[k:k + nlen].decode()
            sections["custom " + cname] += end - i
            if cname == "name":
                k += nlen
                while k < end:
                    sub = buf[k]
                    ssize, k2 = leb(buf, k + 1)
                    if sub == 1:
                        cnt, m = leb(buf, k2)
                        for _ in range(cnt):
                            idx, m = leb(buf, m)
                            ln, m = leb(buf, m)
                            names[idx] = buf[m:m + ln].decode(errors="replace")
                            m += ln
                    k = k2 + ssize
        else:
            label = {1: "type", 2: "import", 3: "function", 4: "table", 5: "memory", 6: "global",
                     7: "export", 9: "elem", 10: "code", 11: "data", 12: "datacount"}.get(sid, str(sid))
            sections[label] += end - i
            if sid == 2:
                cnt, m = leb(buf, j)
                for _ in range(cnt):
                    for _ in range(2):
                        ln, m = leb(buf, m)
                        m += ln
                    kind = buf[m]
                    m += 1
                    if kind == 0:
                        _, m = leb(buf, m)
                        imported += 1
                    elif kind == 1:
                        m += 1
                        flags = buf[m]; m += 1
                        _, m = leb(buf, m)
                        if flags & 1:
                            _, m = leb(buf, m)
                    elif kind == 2:
                        flags = buf[m]; m += 1
                        _, m = leb(buf, m)
                        if flags & 1:
                            _, m = leb(buf, m)
                    elif kind == 3:
                        m += 2
            if sid == 10:
                cnt, m = leb(buf, j)
                for f in range(cnt):
                    bsize, m2 = leb(buf, m)
                    bodies.append((imported + f, m2 + bsize - m))
                    m = m2 + bsize
        i = end
    print(f"{path}: {len(buf):,} bytes")
    for k, v in sections.most_common():
        print(f"  section {k:24} {v:>9,}")
    crates, funcs, copies = Counter(), Counter(), Counter()
    for idx, size in bodies:
        name = demangle(names.get(idx, f"func[{idx}]"))
        funcs[name] += size
        copies[name] += 1
        crates[crate_of(name)] += size
    print(f"code bytes per crate ({len(bodies)} functions):")
    for k, v in crates.most_common(25):
        print(f"  {v:>9,}  {k}")
    print("largest functions (a generic function's copies summed: how many in brackets):")
    for k, v in funcs.most_common(top):
        n = f"[{copies[k]}] " if copies[k] > 1 else ""
        print(f"  {v:>9,}  {n}{k[:150]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
