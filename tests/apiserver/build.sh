#!/usr/bin/env bash
# Builds staleguard-apiserver (the test Kubernetes API server, see
# docs/apiserver.md) from Debian sid's Go library packages, offline, and prints
# the binary's path as the last line of stdout. Progress goes to stderr.
#
#   tests/apiserver/build.sh            build (or reuse the cached binary)
#   tests/apiserver/build.sh --relock   re-resolve the package set from sid's
#                                       dependency closure and rewrite
#                                       packages.lock with what the build uses
#
# The machine's own apt sources are never touched: a separate apt configuration
# (own sources list, lists, cache and status) lives in the cache directory, and
# packages are fetched with `apt-get download` and unpacked with `dpkg -x`.
#
# Cache (${STALEGUARD_CACHE:-~/.cache/staleguard}):
#   apiserver-apt/              the separate apt configuration and sid's lists
#   apiserver-debs/             downloaded .debs (names carry versions)
#   apiserver-<key>/            per package set (key: hash of name=version list)
#     root/                     the unpacked packages (Go toolchain + GOPATH)
#     bin-<src>/                the binary, per hash of the Go source
#   apiserver-gocache/          Go's build cache (makes source edits cheap)
set -euo pipefail
export LC_ALL=C

here=$(cd "$(dirname "$0")" && pwd)
cache=${STALEGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/staleguard}
lock=$here/packages.lock
relock=false
[[ ${1:-} == --relock ]] && relock=true

# What the server is built from, and the versions its code is written for.
go_version=1.27
roots=(
  "golang-$go_version-go" "golang-$go_version-src"
  golang-k8s-apiserver-dev golang-k8s-api-dev golang-k8s-apimachinery-dev
  golang-k8s-client-go-dev golang-etcd-server-dev
)
declare -A expect=(
  [golang-k8s-apiserver-dev]='0.36.*' [golang-k8s-api-dev]='0.36.*'
  [golang-k8s-apimachinery-dev]='0.36.*' [golang-k8s-client-go-dev]='0.36.*'
  [golang-etcd-server-dev]='3.5.*'
)

t0=$SECONDS
step() { printf '[apiserver %3ds] %s\n' $((SECONDS - t0)) "$*" >&2; }
die() {
  printf 'error: staleguard-apiserver cannot be built: %s\n' "$*" >&2
  exit 1
}
hash_of() { sha256sum | cut -c1-16; }
trap 'die "unexpected failure at build.sh line $LINENO (exit $?)"' ERR

src_hash=$(cd "$here" && cat ./*.go go.mod build.sh resolve.py | hash_of)

# === fast path: a binary built from the locked packages and this source ===
if ! $relock && [[ -f $lock ]]; then
  pkg_key=$(grep -v "^#" "$lock" | hash_of)
  bin=$cache/apiserver-$pkg_key/bin-$src_hash/staleguard-apiserver
  if [[ -x $bin ]]; then
    step "cached: $bin"
    echo "$bin"
    exit 0
  fi
fi

# === the separate apt configuration for Debian sid ===
apt_dir=$cache/apiserver-apt
mkdir -p "$apt_dir"/{lists/partial,archives/partial,parts,prefs,conf}
: >"$apt_dir/status"
# The mirror is the one this machine's own apt uses, so no host is named here.
mirror=${STALEGUARD_DEBIAN_MIRROR:-$(
  sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
    -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\)[[:space:]].*/\2/p' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    grep -v -e security -e '^$' | awk 'NR == 1' || true
)}
[[ -n $mirror ]] || die "no Debian mirror found in /etc/apt (set STALEGUARD_DEBIAN_MIRROR)"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
echo "deb [signed-by=$keyring] $mirror sid main" >"$apt_dir/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=$apt_dir/parts"
  -o "Dir::Etc::Preferences=$apt_dir/prefs/none" -o "Dir::Etc::PreferencesParts=$apt_dir/prefs"
  -o "Dir::Etc::Parts=$apt_dir/conf"
  -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::State::status=$apt_dir/status"
  -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives"
  -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
  -o Acquire::Languages=none -o APT::Architecture=amd64 -o APT::Architectures::=amd64
  -o APT::Sandbox::User=root
  # AppStream metadata (enabled by the host's apt.conf.d) is of no use here.
  -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
  -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
  -o Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false
)
stamp=$apt_dir/lists/.updated
if $relock || [[ ! -f $stamp ]] || [[ -n $(find "$stamp" -mmin +360) ]]; then
  step "updating Debian sid package lists (separate apt config in $apt_dir)"
  apt-get "${apt_opts[@]}" -q --error-on=any update >&2 ||
    die "apt-get update for sid failed: is the Debian mirror $mirror reachable?"
  touch "$stamp"
fi

avail=$apt_dir/available
apt-cache "${apt_opts[@]}" dumpavail >"$avail"
[[ -s $avail ]] || die "no package lists for sid in $apt_dir/lists (did apt-get update fail?)"
declare -A sid_versions=()
while read -r name version; do
  sid_versions[$name]=$version
done < <(awk '$1 == "Package:" {p = $2} $1 == "Version:" {print p, $2}' "$avail")
version_in_sid() { echo "${sid_versions[$1]:-}"; }

for pkg in "${!expect[@]}"; do
  v=$(version_in_sid "$pkg")
  [[ -n $v ]] || die "sid moved under us: it no longer has $pkg"
  # shellcheck disable=SC2053 # the right side is a glob on purpose
  [[ $v == ${expect[$pkg]} ]] ||
    die "sid moved under us: $pkg is $v there, the server is written for ${expect[$pkg]}; port tests/apiserver to it and run build.sh --relock"
done

# === the package set ===
wanted=$apt_dir/wanted
moved=()
if $relock || [[ ! -f $lock ]]; then
  step "resolving the Go library dependency closure of: ${roots[*]}"
  python3 "$here/resolve.py" "${roots[@]}" <"$avail" >"$wanted" || die "resolving dependencies failed"
else
  : >"$wanted"
  while IFS='=' read -r name version; do
    [[ -z $name || $name == \#* ]] && continue
    now=$(version_in_sid "$name")
    [[ -n $now ]] || die "sid moved under us: $name (locked at $version) is gone from sid; run build.sh --relock"
    [[ $now == "$version" ]] || moved+=("$name $version -> $now")
    echo "$name=$now" >>"$wanted"
  done <"$lock"
  if ((${#moved[@]})); then
    step "sid moved under us (only the current version can be downloaded), building with:"
    printf '    %s\n' "${moved[@]}" >&2
  fi
fi
pkg_key=$(hash_of <"$wanted")
dir=$cache/apiserver-$pkg_key
bin=$dir/bin-$src_hash/staleguard-apiserver
if [[ -x $bin ]] && ! $relock; then
  step "cached: $bin"
  echo "$bin"
  exit 0
fi

debs=$cache/apiserver-debs
mkdir -p "$debs"
missing=()
while IFS='=' read -r name version; do
  # The file name apt gives a .deb: the epoch's colon is %3a.
  file="${name}_${version/:/%3a}_"
  compgen -G "$debs/$file*.deb" >/dev/null || missing+=("$name=$version")
done <"$wanted"
if ((${#missing[@]})); then
  step "downloading ${#missing[@]} of $(wc -l <"$wanted") packages into $debs"
  (cd "$debs" && apt-get "${apt_opts[@]}" -q download "${missing[@]}" >&2) ||
    die "apt-get download failed for some of: ${missing[*]}"
fi

root=$dir/root
if [[ ! -f $root/.unpacked ]]; then
  step "unpacking $(wc -l <"$wanted") packages into $root"
  rm -rf "$root"
  mkdir -p "$root"
  while IFS='=' read -r name version; do
    dpkg -x "$(compgen -G "$debs/${name}_${version/:/%3a}_*.deb" | awk 'NR == 1')" "$root"
  done <"$wanted"
  touch "$root/.unpacked"
fi

# === build, offline, in GOPATH mode ===
goroot=$root/usr/lib/go-$go_version
gocode=$root/usr/share/gocode
[[ -x $goroot/bin/go ]] || die "golang-$go_version-go did not unpack a go binary at $goroot/bin/go"
overlay=$dir/overlay
rm -rf "$overlay"
mkdir -p "$overlay/src/staleguard" "$overlay/src/go.etcd.io/etcd/server"
# Our code, inside a GOPATH, with a go.mod: that is what lets Go resolve /vN
# import paths against packages unpacked without the /vN directory.
ln -s "$here" "$overlay/src/staleguard/apiserver"
# The etcd server is imported as go.etcd.io/etcd/server/v3 but unpacked
# without /v3, and the resolution above does not find it: alias it.
ln -s "$gocode/src/go.etcd.io/etcd/server" "$overlay/src/go.etcd.io/etcd/server/v3"

out=$dir/bin-$src_hash
mkdir -p "$out"
step "building with go $go_version (GOPATH mode, offline; a cold build takes minutes)"
build() {
  env -u GOFLAGS GOROOT="$goroot" PATH="$goroot/bin:$PATH" GOPATH="$overlay:$gocode" \
    GO111MODULE=off GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 GOTELEMETRY=off \
    GOCACHE="$cache/apiserver-gocache" "$@"
}
if ! build go build -trimpath -ldflags=-s -o "$out/staleguard-apiserver.tmp" staleguard/apiserver >&2; then
  if ((${#moved[@]})); then
    die "the build failed after sid moved under us (${moved[*]}); port the code or run build.sh --relock"
  fi
  die "go build failed (see above)"
fi
mv "$out/staleguard-apiserver.tmp" "$out/staleguard-apiserver"
step "built $out/staleguard-apiserver ($(du -h "$out/staleguard-apiserver" | cut -f1))"

if $relock; then
  # Keep only the packages the build read: the Debian closure is much larger
  # than what the server imports (tests, tools and optional backends).
  step "computing which packages the build uses"
  build go list -deps -f '{{if not .Standard}}{{.Dir}}{{end}}' staleguard/apiserver |
    sed "s|^$gocode/||; s|^$overlay/src/go.etcd.io/etcd/server/v3|src/go.etcd.io/etcd/server|" |
    grep '^src/' | sort -u >"$apt_dir/used-dirs"
  {
    echo "# Debian sid packages staleguard-apiserver is built from (build.sh --relock writes this)."
    while IFS='=' read -r name version; do
      deb=$(compgen -G "$debs/${name}_${version/:/%3a}_*.deb" | awk 'NR == 1')
      case $name in golang-$go_version-*)
        echo "$name=$version"
        continue
        ;;
      esac
      # A package is used if it ships a .go file in a directory the build read.
      # (wc, not grep -q: an early exit would break the pipe, and pipefail.)
      shared=$(dpkg-deb -c "$deb" | awk '$6 ~ /^\.\/usr\/share\/gocode\/.*\.go$/ {print $6}' |
        sed 's|^\./usr/share/gocode/||; s|/[^/]*$||' | sort -u | comm -12 - "$apt_dir/used-dirs" | wc -l)
      if ((shared > 0)); then
        echo "$name=$version"
      fi
    done <"$wanted"
  } >"$lock.tmp"
  mv "$lock.tmp" "$lock"
  step "wrote $lock ($(grep -vc '^#' "$lock") packages)"
  # The binary is cached under the key of the new lock, so the fast path finds it.
  new_key=$(grep -v '^#' "$lock" | hash_of)
  mkdir -p "$cache/apiserver-$new_key/bin-$src_hash"
  cp "$out/staleguard-apiserver" "$cache/apiserver-$new_key/bin-$src_hash/"
fi
echo "$out/staleguard-apiserver"
