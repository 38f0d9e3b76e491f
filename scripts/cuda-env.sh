#!/usr/bin/env bash
# Prepares a CUDA 13.0 toolchain from NVIDIA's PyPI wheels and prints the `export` lines that
# point a shell at it:
#
#     eval "$(bash scripts/cuda-env.sh)"
#     cargo build --features cuda
#
# Debian's main archive has no CUDA toolkit, but NVIDIA publishes one on PyPI. The wheels are
# installed (once) into target/cuda-toolchain/ of this repository and assembled there into one
# CUDA_HOME folder laid out as nvcc and cudarc's build script expect. That is enough to compile
# and link; nothing here runs on a GPU. Stdout carries only the export lines (progress goes to
# stderr), and a second run reuses what the first built.
#
# Needs python3 (with pip or venv; as root on Debian it installs python3-venv if both are
# missing), gcc, and network access to PyPI the first time.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
top="$repo/target/cuda-toolchain"
home="$top/cuda"

# Pinned: an unpinned nvcc pulls pieces of a newer CUDA; cudarc 0.19.10's NCCL bindings are
# for NCCL 2.30.
wheels=(
    'nvidia-cuda-nvcc==13.0.*'
    'nvidia-cuda-runtime==13.0.*'
    'nvidia-cuda-cccl==13.0.*'
    'nvidia-cuda-crt==13.0.*'
    'nvidia-nvvm==13.0.*'
    'nvidia-cuda-nvrtc==13.0.*'
    'nvidia-cublas==13.0.*'
    'nvidia-curand==10.4.0.35'
    'nvidia-nccl-cu13==2.30.7'
)

log() { echo "cuda-env: $*" >&2; }
die() { log "$*"; exit 1; }

# The cudarc that candle uses, from Cargo.lock: its driver bindings name the symbols the
# libcuda stub must define.
cudarc_version=$(awk '/^name = "cudarc"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' "$repo/Cargo.lock" 2> /dev/null || true)
[ -n "$cudarc_version" ] || die "no cudarc in $repo/Cargo.lock (run cargo generate-lockfile first)"

# Everything the folder depends on; a change rebuilds it.
stamp_text="wheels=${wheels[*]} cudarc=$cudarc_version layout=1"

print_exports() {
    local path="$home/bin"
    case ":$PATH:" in
        *":$path:"*) path="$PATH" ;;
        *) path="$path:$PATH" ;;
    esac
    printf 'export CUDA_HOME=%q\n' "$home"
    printf 'export CUDA_PATH=%q\n' "$home"
    printf 'export PATH=%q\n' "$path"
    # No GPU to ask (no nvidia-smi): build for the H100/H200 class, compute_90 PTX plus sm_90a.
    printf 'export CUDA_COMPUTE_CAP=%q\n' "${CUDA_COMPUTE_CAP:-90}"
    # The libcuda stub sits in lib64/stubs, which cudarc's build script puts on the linker
    # path from CUDA_HOME by itself; nothing goes on LD_LIBRARY_PATH, so a real driver wins at
    # run time.
}

if [ -f "$home/.stamp" ] && [ "$(cat "$home/.stamp")" = "$stamp_text" ] && "$home/bin/nvcc" --version > /dev/null 2>&1; then
    print_exports
    exit 0
fi

mkdir -p "$top"

# --- 1. The wheels ----------------------------------------------------------------------------
# A virtual environment of our own (no PEP 668 refusal, nothing in the system's site-packages);
# without the venv module, pip's --target; as root on Debian, the missing packages from apt.
site=""
make_venv() {
    rm -rf "$top/venv"
    python3 -m venv "$top/venv" > /dev/null 2>&1 && "$top/venv/bin/python" -m pip --version > /dev/null 2>&1
}
# No wheel cache: it would hold a second copy of the 1.5 GB (a CI machine's disk may be small).
pip_install() {
    if [ -n "$site" ]; then
        python3 -m pip install -q --no-cache-dir --disable-pip-version-check --target "$site" "${wheels[@]}" >&2
    else
        "$top/venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "${wheels[@]}" >&2
    fi
}
command -v python3 > /dev/null || die "python3 is needed to install NVIDIA's CUDA wheels"
if [ -x "$top/venv/bin/python" ] && "$top/venv/bin/python" -m pip --version > /dev/null 2>&1; then
    :
elif make_venv; then
    log "created $top/venv"
elif python3 -m pip --version > /dev/null 2>&1; then
    site="$top/site"
    log "no venv module: installing with pip --target $site"
elif [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    log "installing python3-venv and python3-pip with apt-get"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip > /dev/null
    make_venv || die "python3 -m venv still fails after installing python3-venv"
else
    die "python3 has neither venv nor pip: install python3-venv (or python3-pip) first"
fi
log "installing ${wheels[*]} (pip; about 1.5 GB on disk)"
pip_install
if [ -z "$site" ]; then
    site=$("$top/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fi
cu="$site/nvidia/cu13"
nccl="$site/nvidia/nccl"
[ -x "$cu/bin/nvcc" ] || die "no nvcc in $cu/bin after pip install"
[ -f "$nccl/include/nccl.h" ] || die "no nccl.h in $nccl/include after pip install"

# --- 2. One CUDA_HOME -------------------------------------------------------------------------
log "assembling $home"
rm -rf "$home"
mkdir -p "$home/bin" "$home/include" "$home/lib64/stubs"
# nvcc resolves its own path and reads ../lib64 and ../include next to it: a symlink to the
# wheel's nvcc would look beside the wheel (and fail with `cannot find -lcudadevrt`), so nvcc
# and its profile are real copies; the tools it calls can be links.
for f in "$cu"/bin/*; do
    case "$(basename "$f")" in
        nvcc | nvcc.profile) cp "$f" "$home/bin/" ;;
        *) ln -s "$f" "$home/bin/" ;;
    esac
done
ln -s "$cu/nvvm" "$home/nvvm"
for f in "$cu"/include/* "$nccl"/include/*; do
    ln -sfn "$f" "$home/include/"
done
# The shared libraries under their versioned names and the unversioned ones the linker asks
# for (-lcudart, -lcublas, -lnccl, ...); static archives (libcudadevrt.a) as they are.
for f in "$cu"/lib/*.so* "$cu"/lib/*.a "$nccl"/lib/*.so*; do
    [ -e "$f" ] || continue
    name=$(basename "$f")
    ln -sfn "$f" "$home/lib64/$name"
    case "$name" in
        *.so.*) ln -sfn "$f" "$home/lib64/${name%%.so.*}.so" ;;
    esac
done

# --- 3. A link-only libcuda.so ----------------------------------------------------------------
# The driver library ships with the driver, not in any wheel, but cudarc links -lcuda. The stub
# defines every cu* function cudarc binds (empty bodies: it only has to satisfy the linker) and
# carries the real library's SONAME, so binaries ask for libcuda.so.1 and get the driver's.
registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
find_bindings() { compgen -G "$registry/*/cudarc-$cudarc_version/src/driver/sys/mod.rs" | head -n 1 || true; }
bindings=$(find_bindings)
if [ -z "$bindings" ]; then
    log "fetching crates (cudarc $cudarc_version's sources)"
    cargo fetch --manifest-path "$repo/Cargo.toml" >&2
    bindings=$(find_bindings)
fi
[ -n "$bindings" ] || die "cudarc-$cudarc_version not found under $registry"
stub_c="$home/lib64/stubs/cuda_stub.c"
grep -oE '\bfn cu[A-Za-z0-9_]+\(' "$bindings" | sed -E 's/^fn (cu[A-Za-z0-9_]+)\($/void \1(void) {}/' | sort -u > "$stub_c"
[ "$(wc -l < "$stub_c")" -gt 100 ] || die "found too few cu* names in $bindings"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" "$stub_c"

"$home/bin/nvcc" --version | grep -q 'release 13\.0' || die "$home/bin/nvcc is not CUDA 13.0"
echo "$stamp_text" > "$home/.stamp"
log "ready: $home ($("$home/bin/nvcc" --version | grep -o 'release [0-9.]*'), $(wc -l < "$stub_c") stub symbols)"
print_exports
