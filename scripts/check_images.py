#!/usr/bin/env python3
"""Checks the manifests `kubectl kustomize` rendered from deploy/ against the
images scripts/images built into target/images (scripts/check-deploy calls
this): every container that names one of them must run it the way the image
says, so a mistake shows here rather than at a user's first `kubectl apply -k`.
Reads the OCI layouts alone (no container engine, no unpacking as root).

For each such container:
- the reference is REGISTRY/NAME:TAG with the layout's tag, or
  REGISTRY/NAME@DIGEST with the manifest's digest;
- no `command` (the image's Entrypoint runs);
- every `--flag` of `args` is one the image's binary lists in its `--help`
  (that of the subcommand, when args start with one);
- runAsUser and runAsGroup (the container's, else the pod's) are the image's
  User, runAsNonRoot and readOnlyRootFilesystem are set;
- every containerPort is one the image exposes, and the port of every
  `--*listen=` flag is a containerPort.
Also: the module image holds plugin.wasm, marked as Istio's compat variant (the
EnvoyFilter's URI names the workspace version, which is the images' tag:
scripts/check_deploy.py checks that).
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

import yaml

problems = []


def problem(where, what):
    problems.append(f"{where}: {what}")


def blob(layout, digest):
    algo, hexa = digest.split(":", 1)
    return json.loads((layout / "blobs" / algo / hexa).read_text())


class Image:
    """One OCI layout written by scripts/images."""

    def __init__(self, name, layout, scratch):
        self.name = name
        self.layout = pathlib.Path(layout)
        self.scratch = scratch
        (desc,) = json.loads((self.layout / "index.json").read_text())["manifests"]
        self.digest = desc["digest"]
        self.tag = desc["annotations"]["org.opencontainers.image.ref.name"]
        self.manifest = blob(self.layout, self.digest)
        self.config = blob(self.layout, self.manifest["config"]["digest"]).get("config", {})
        self._help = {}

    def file(self, path):
        """The bytes of PATH in the image's layers (the last layer that has it), or None."""
        found = None
        for layer in self.manifest["layers"]:
            algo, hexa = layer["digest"].split(":", 1)
            with tarfile.open(self.layout / "blobs" / algo / hexa) as tar:
                for m in tar:
                    if m.isfile() and m.name.lstrip("./") == path.lstrip("/"):
                        found = tar.extractfile(m).read()
        return found

    def flags(self, subcommand):
        """The flags the entrypoint's `--help` lists (a subcommand's, if given)."""
        if subcommand not in self._help:
            entry = self.config["Entrypoint"]
            binary = pathlib.Path(self.scratch) / self.name
            if not binary.exists():
                data = self.file(entry[0])
                if data is None:
                    problem(self.name, f"its entrypoint {entry[0]} is not in the image")
                    data = b""
                binary.write_bytes(data)
                os.chmod(binary, 0o755)
            argv = [str(binary), *entry[1:], *([subcommand] if subcommand else []), "--help"]
            out = subprocess.run(argv, capture_output=True, text=True, check=False, env={})
            if out.returncode != 0:
                problem(self.name, f"`{' '.join(argv[1:])}` exits {out.returncode}: {out.stderr.strip()}")
            self._help[subcommand] = set(re.findall(r"--[a-z0-9][a-z0-9-]*", out.stdout))
        return self._help[subcommand]


def pod_specs(obj):
    """Pod specs in a manifest or a strategic-merge patch of one."""
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    if isinstance(template.get("spec"), dict):
        yield template["spec"]
    elif obj.get("kind") == "Pod":
        yield spec


def check_container(where, pod, c, image):
    ref = c["image"]
    tail = ref.split("/")[-1]
    if "@" in tail:
        if tail.split("@", 1)[1] != image.digest:
            problem(where, f"{ref}: the image scripts/images builds is {image.digest}")
    elif tail != f"{image.name}:{image.tag}":
        problem(where, f"{ref}: scripts/images builds {image.name}:{image.tag}")
    if "command" in c:
        problem(where, f"sets command {c['command']}: the image's entrypoint is {image.config.get('Entrypoint')}")

    args = c.get("args", [])
    sub = args[0] if args and not args[0].startswith("-") else None
    known = image.flags(sub)
    for a in args[1 if sub else 0 :]:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            problem(where, f"arg {a}: `{image.name} {sub or ''} --help` lists no {flag}")

    uid, _, gid = image.config.get("User", "").partition(":")
    psc, csc = pod.get("securityContext") or {}, c.get("securityContext") or {}
    for field, want in (("runAsUser", uid), ("runAsGroup", gid)):
        have = csc.get(field, psc.get(field))
        if str(have) != want:
            problem(where, f"{field} is {have}, the image's user is {image.config.get('User')}")
    if not csc.get("runAsNonRoot", psc.get("runAsNonRoot")):
        problem(where, "runAsNonRoot is not set (the image's user is not root)")
    if not csc.get("readOnlyRootFilesystem"):
        problem(where, "readOnlyRootFilesystem is not set (scripts/images --check runs the image read-only)")

    exposed = set(image.config.get("ExposedPorts", {}))
    ports = {p["containerPort"] for p in c.get("ports", [])}
    for p in sorted(ports):
        if f"{p}/tcp" not in exposed:
            problem(where, f"containerPort {p} is not exposed by the image ({', '.join(sorted(exposed))})")
    for a in args:
        m = re.fullmatch(r"--[a-z-]*listen=.*:(\d+)", a)
        if m and int(m.group(1)) not in ports:
            problem(where, f"{a} listens on a port that is no containerPort ({sorted(ports)})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry", required=True, help="the images' registry and path, as deploy/ names it")
    ap.add_argument("--images", required=True, help="the directory of scripts/images's OCI layouts")
    ap.add_argument("rendered", nargs="+")
    args = ap.parse_args()
    scratch = tempfile.TemporaryDirectory()
    images = {}
    for layout in sorted(pathlib.Path(args.images).glob("*/index.json")):
        image = Image(layout.parent.name, layout.parent, scratch.name)
        labels = blob(image.layout, image.manifest["config"]["digest"]).get("config", {}).get("Labels", {})
        print(f"  {image.name}:{image.tag} {image.digest} (revision {labels.get('org.opencontainers.image.revision')})")
        images[image.name] = image

    seen = {name: 0 for name in images}
    for path in map(pathlib.Path, args.rendered):
        for n, obj in enumerate(yaml.safe_load_all(path.read_text())):
            if not isinstance(obj, dict):
                continue
            for pod in pod_specs(obj):
                for c in pod.get("initContainers", []) + pod.get("containers", []):
                    ref = c.get("image", "")
                    if not ref.startswith(args.registry + "/"):
                        continue
                    name = re.split(r"[:@]", ref[len(args.registry) + 1 :])[0]
                    where = f"{path.name}#{n} {obj.get('kind')}/{obj.get('metadata', {}).get('name')} container {c.get('name')}"
                    if name not in images:
                        problem(where, f"{ref}: scripts/images builds no image {name}")
                        continue
                    seen[name] += 1
                    before = len(problems)
                    check_container(where, pod, c, images[name])
                    if len(problems) == before:
                        print(f"  {where}: {ref}, user {images[name].config.get('User')}, {len(c.get('args', []))} args: agree")

    if not seen.get("staleguard-validator"):
        problem("deploy/", "no container runs the staleguard-validator image")
    module = images.get("staleguard-filter")
    if module is None:
        problem(args.images, "has no staleguard-filter image")
    else:
        if module.file("/plugin.wasm") is None:
            problem(module.name, "has no /plugin.wasm")
        if module.manifest.get("annotations", {}).get("module.wasm.image/variant") != "compat":
            problem(module.name, "lacks the annotation module.wasm.image/variant=compat")
    return report()


def report():
    if problems:
        print(f"{len(problems)} problem(s):", *problems, sep="\n  ", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
