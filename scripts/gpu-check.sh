#!/usr/bin/env bash
# Builds, here (no GPU needed), everything the CUDA check runs on a GPU machine, into one
# folder of at most 64 MiB: target/gpu-check/ with
#
#     bins.tar.xz   every test binary (the library's unit tests and each tests/*.rs, the
#                   models' tests/models_*.rs checked to be there) and the bench example,
#                   built in release with `--features cuda`, stripped, in one solid archive
#     run.sh        what the GPU machine runs (see scripts/gpu-check-run.sh)
#     manifest.json what was built, from which commit, and the sizes
#
# Copy the folder to a machine with an NVIDIA driver (CUDA 13.0, driver 580 or newer) and
# Python with the pip packages nvidia-cublas, nvidia-cuda-runtime, nvidia-curand and
# nvidia-nccl-cu13 (the CUDA libraries the binaries link; far too big to carry), then run
# `bash run.sh > result.json`. It needs no Rust and no network and prints one JSON object.
#
# Each binary embeds the same ~48 MB of candle's kernels (PTX and sm_90a code), so they go
# into one solid xz stream whose dictionary spans several binaries: a repeat costs almost
# nothing, where compressing each binary alone would blow the budget.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out="$repo/target/gpu-check"
limit=$((64 * 1024 * 1024))
log() { echo "gpu-check: $*" >&2; }

# Through a variable: `eval "$(...)"` would hide the script's failure from `set -e`.
cuda_env=$(bash scripts/cuda-env.sh)
eval "$cuda_env"
export CARGO_TERM_COLOR=never
stage=$(mktemp -d "${TMPDIR:-/tmp}/candle-amp-gpu-check.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bins/tests"

# The executables cargo reports (a JSON line per artifact), as `name path`.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        name = "lib" if "lib" in t["kind"] else t["name"]
        print(name, m["executable"])
'
}

log "building the test binaries (release, --features cuda)"
nice -n 5 cargo test --release --features cuda --lib --tests --no-run --message-format=json-render-diagnostics \
    | executables > "$stage/tests.txt"
[ -s "$stage/tests.txt" ] || { log "cargo reported no test binaries"; exit 1; }
# The models' tests (Llama, BERT, ViT against candle-transformers, under checkpointing and data
# parallel) must be in the archive: a tests/models_*.rs that built no binary stops the script.
for f in tests/models_*.rs; do
    t=$(basename "$f" .rs)
    grep -q "^$t " "$stage/tests.txt" || { log "no test binary for $f"; exit 1; }
done
log "building the bench example"
nice -n 5 cargo build --release --features cuda --example bench --message-format=json-render-diagnostics \
    | executables > "$stage/bench.txt"
[ -s "$stage/bench.txt" ] || { log "cargo reported no bench binary"; exit 1; }

while read -r name path; do
    strip -o "$stage/bins/tests/$name" "$path"
done < "$stage/tests.txt"
read -r _ bench < "$stage/bench.txt"
strip -o "$stage/bins/bench" "$bench"
raw=$(du -sb "$stage/bins" | cut -f1)
log "$(wc -l < "$stage/tests.txt") test binaries and the bench, $((raw / 1048576)) MiB stripped; compressing"

rm -rf "$out"
mkdir -p "$out"
# Sorted so that similar binaries sit next to each other; a 256 MiB dictionary reaches back
# over several whole binaries (decompressing needs that much memory, which any GPU host has).
(cd "$stage/bins" && find . -type f | LC_ALL=C sort | tar --owner=0 --group=0 --numeric-owner -cf - -T - \
    | xz -T1 -6 --lzma2=preset=6,dict=256MiB > "$out/bins.tar.xz")
cp scripts/gpu-check-run.sh "$out/run.sh"
chmod +x "$out/run.sh"
python3 - "$out" "$raw" "$stage/tests.txt" <<'PY'
import json, os, subprocess, sys
out, raw, tests = sys.argv[1], int(sys.argv[2]), sys.argv[3]
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
m = {
    "commit": commit,
    "dirty": dirty,
    "features": ["cuda"],
    "profile": "release",
    "cuda_compute_cap": os.environ.get("CUDA_COMPUTE_CAP"),
    "tests": [l.split()[0] for l in open(tests)],
    "models": sorted(l.split()[0] for l in open(tests) if l.startswith("models_")),
    "stripped_bytes": raw,
    "archive_bytes": os.path.getsize(os.path.join(out, "bins.tar.xz")),
}
json.dump(m, open(os.path.join(out, "manifest.json"), "w"), indent=1)
PY
size=$(du -sb "$out" | cut -f1)
log "$out: $((size / 1048576)) MiB ($size bytes; limit 64 MiB)"
if [ "$size" -gt "$limit" ]; then
    log "over the 64 MiB limit"
    exit 1
fi
