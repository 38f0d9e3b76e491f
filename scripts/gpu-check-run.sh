#!/usr/bin/env bash
# The GPU side of scripts/gpu-check.sh (copied into target/gpu-check/ as run.sh): run it there
# on a machine with an NVIDIA GPU, its driver (CUDA 13.0: driver 580 or newer) and Python with
# the pip packages nvidia-cublas, nvidia-cuda-runtime, nvidia-curand and nvidia-nccl-cu13.
# No Rust, no network.
#
#     bash run.sh > result.json
#
# Unpacks the binaries, finds the CUDA libraries in Python's site-packages, runs every test
# binary with CANDLE_AMP_TEST_DEVICE=cuda (pass/fail counts per binary; the models' binaries
# first, their statuses also under "models"), then the bench on CUDA (its Llama row included),
# and prints ONE JSON object on stdout (progress on stderr). Everything together stays
# under 10 minutes: each binary gets what the others leave (at most 4 minutes), and a binary
# that runs out of it is stopped and reported as timed out. Exit status 0 when every test
# passed and the bench gave its JSON.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "run.sh: $*" >&2; }
now() { date +%s; }
start=$(now)
budget=${GPU_CHECK_BUDGET_S:-570}   # the whole run, seconds
bench_reserve=150                  # kept for the bench while the tests run
per_binary_cap=240                 # the most one test binary may take

work=$(mktemp -d "${TMPDIR:-/tmp}/candle-amp-gpu-run.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/logs"

# --- the CUDA libraries from pip: every lib/ folder of the nvidia namespace package --------
lib_dirs=$(python3 - <<'PY'
import glob, os, site, sys
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except ImportError:
    pass
paths = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
roots += [os.path.join(p, "nvidia") for p in paths if p]
seen = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "*", "lib"))):
        d = os.path.realpath(d)
        if d not in seen and glob.glob(os.path.join(d, "lib*.so*")):
            seen.append(d)
print(":".join(seen))
PY
)
[ -n "$lib_dirs" ] || log "no nvidia/*/lib in Python's site-packages: the binaries will not find libcudart/libcublas"
# The driver's libcuda.so.1 comes from the system's library path.
export LD_LIBRARY_PATH="$lib_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- unpack ---------------------------------------------------------------------------------
log "unpacking into $work"
if command -v xz > /dev/null; then
    tar -xJf "$here/bins.tar.xz" -C "$work"
else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$here/bins.tar.xz" "$work"
fi
unpack_s=$(($(now) - start))

gpu=""
if command -v nvidia-smi > /dev/null; then
    gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | head -n 1)
fi

# --- the tests ------------------------------------------------------------------------------
export CANDLE_AMP_TEST_DEVICE=cuda RUST_BACKTRACE=1
: > "$work/tests.tsv"
# The models' binaries (models_*: Llama, BERT, ViT) first, so that a run short of time skips
# from the end of the list and never them; the others in name order.
bins=$(cd "$work/tests" && ls | LC_ALL=C sort | awk '/^models_/ { print; next } { rest = rest $0 "\n" } END { printf "%s", rest }')
count=$(echo "$bins" | wc -w)
i=0
for name in $bins; do
    i=$((i + 1))
    # A binary may use what the others leave (most take seconds; a CPU-bound one minutes),
    # up to a cap, but never the bench's reserve nor 10 s for each binary still to come.
    limit=$((budget - bench_reserve - ($(now) - start) - 10 * (count - i)))
    [ "$limit" -le "$per_binary_cap" ] || limit=$per_binary_cap
    if [ "$limit" -lt 5 ]; then
        printf '%s\t%s\t%s\n' "$name" "skipped" 0 >> "$work/tests.tsv"
        continue
    fi
    log "[$i/$count] $name (up to ${limit}s)"
    t0=$(now)
    (cd "$work" && timeout -k 5 "$limit" "./tests/$name" > "logs/$name.log" 2>&1)
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" $(($(now) - t0)) >> "$work/tests.tsv"
done

# --- the bench ------------------------------------------------------------------------------
left=$((budget - ($(now) - start)))
[ "$left" -gt 10 ] || left=10
log "bench --device cuda --json (up to ${left}s)"
t0=$(now)
(cd "$work" && timeout -k 5 "$left" ./bench --device cuda --json > bench.out 2> bench.err)
bench_rc=$?
bench_s=$(($(now) - t0))

# --- one JSON object ------------------------------------------------------------------------
python3 - "$work" "$gpu" "$lib_dirs" "$unpack_s" "$bench_rc" "$bench_s" "$(($(now) - start))" "$here/manifest.json" <<'PY'
import json, os, re, sys
work, gpu, lib_dirs, unpack_s, bench_rc, bench_s, total_s, manifest = sys.argv[1:9]
tests, passed, failed, ok = {}, 0, 0, True
for line in open(os.path.join(work, "tests.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    r = {"seconds": int(secs)}
    if rc == "skipped":
        r.update(status="skipped: no time left", passed=0, failed=0, ignored=0)
        ok = False
    else:
        rc = int(rc)
        text = open(os.path.join(work, "logs", name + ".log"), errors="replace").read()
        # libtest's summary: "test result: ok. 12 passed; 0 failed; 1 ignored; ..."
        counts = [tuple(map(int, m)) for m in re.findall(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", text)]
        p = sum(c[0] for c in counts); f = sum(c[1] for c in counts); ig = sum(c[2] for c in counts)
        status = "ok" if rc == 0 else ("timed out" if rc in (124, 137) else "failed (exit %d)" % rc)
        r.update(status=status, exit=rc, passed=p, failed=f, ignored=ig)
        if rc != 0:
            ok = False
            r["failures"] = re.findall(r"^test (\S+) \.\.\. FAILED", text, re.M)
            r["tail"] = text[-3000:]
        passed += p; failed += f
    tests[name] = r
bench = None
out = open(os.path.join(work, "bench.out"), errors="replace").read().strip()
err = open(os.path.join(work, "bench.err"), errors="replace").read()
bench_error = None
try:
    bench = json.loads(out.splitlines()[-1]) if out else None
except ValueError:
    pass
if int(bench_rc) != 0 or bench is None:
    ok = False
    bench_error = "exit %s: %s" % (bench_rc, (err or out)[-3000:])
try:
    built = json.load(open(manifest))
except (OSError, ValueError):
    built = None
# The models' tests on their own line of the summary: pass/fail per binary.
models = {n: t["status"] for n, t in tests.items() if n.startswith("models_")}
if not models:
    ok = False
print(json.dumps({
    "ok": ok,
    "models": models,
    "gpu": gpu or None,
    "built": built,
    "lib_dirs": [d for d in lib_dirs.split(":") if d],
    "tests_passed": passed,
    "tests_failed": failed,
    "tests": tests,
    "bench": bench,
    "bench_error": bench_error,
    "seconds": {"unpack": int(unpack_s), "tests": sum(t["seconds"] for t in tests.values()), "bench": int(bench_s), "total": int(total_s)},
}))
sys.exit(0 if ok else 1)
PY
