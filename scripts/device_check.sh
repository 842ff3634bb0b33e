#!/usr/bin/env bash
# The GPU check, in one command, for a machine with CUDA torch but without
# pyzmq or Jupyter, and without network:   bash scripts/device_check.sh
#
#  1. uses .venv/bin/python when the project's venv exists (scripts/setup.sh), else
#     python3 with the wheels of .whl/ (pyzmq, for a machine without network that has
#     CUDA torch, numpy, cloudpickle, psutil, pytest) installed into /tmp/site; the
#     project is on PYTHONPATH=/tmp/site:<repo>, which the workers inherit;
#  2. prints nvidia-smi and the python / torch / CUDA / NCCL / pyzmq versions;
#  3. runs the GPU tests and the data-plane tests (files that exist);
#  4. runs benchmarks/gpu.py (CUDA tensors through actor calls vs torch copies).
#
# Every step runs under `timeout`, within one budget (BUDGET seconds, default 230);
# a failing step does not stop the later ones; the exit status is the worst one.
# What comes back is written to $OUT (8 files): env.txt, pytest.log,
# pytest-junit.xml, gpu_bench.log, gpu_bench.json, cpu_bench.log, cpu_bench.json,
# summary.txt. Then the CPU benchmark suite (CPU_BUDGET seconds more, default 150).
#
# Overrides (for a dry run elsewhere): PY (python3), WHEELS (.whl), SITE (/tmp/site),
# OUT (build/device_check), BUDGET, BENCH_ARGS (extra arguments of benchmarks/gpu.py),
# PYTEST_X (-x: stop at the first failure; PYTEST_X= runs every test file to its end).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
if [ -z "${PY:-}" ]; then  # the project's venv when there is one, else the machine's python3
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$REPO/build/device_check}
BUDGET=${BUDGET:-230}
BENCH_T=75                     # seconds kept for the benchmark
CPU_BUDGET=${CPU_BUDGET:-150}  # seconds for the CPU suite (after BUDGET)
PYTEST_X=${PYTEST_X-}
mkdir -p "$OUT"
status=0
summary=()

step() { echo; echo "===== $* [t=${SECONDS}s]"; }
record() {  # record NAME RC
    summary+=("$1: rc=$2 (t=${SECONDS}s)")
    if [ "$2" -gt "$status" ]; then status=$2; fi
}
left() { echo $((BUDGET - SECONDS)); }

# ------------------------------------------------------------------ 1. wheels
if compgen -G "$WHEELS/*.whl" > /dev/null; then  # (a machine without network: carried wheels)
    step "install $WHEELS/*.whl into $SITE" | tee "$OUT/env.txt"
    timeout -k 5 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$OUT/env.txt"
    record install $?
else
    : > "$OUT/env.txt"
fi
export PYTHONPATH="$SITE:$REPO"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- 2. machine
{
    step "nvidia-smi"
    timeout -k 2 15 nvidia-smi 2>&1 || echo "(nvidia-smi failed: rc=$?)"
    step "memory, /dev/shm (shared-memory data plane), /tmp"
    free -g 2>&1; df -h /dev/shm /tmp 2>&1; echo "cpus: $(nproc)"
    step "versions"
    timeout -k 5 40 "$PY" - <<'EOF' 2>&1 || echo "(version probe failed: rc=$?)"
import os, platform, sys
print("python", sys.version.split()[0], sys.executable, "|", platform.platform())
print("PYTHONPATH", os.environ.get("PYTHONPATH"), "| CUDA_VISIBLE_DEVICES",
      os.environ.get("CUDA_VISIBLE_DEVICES"), "| cpus", os.cpu_count())
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available",
      torch.cuda.is_available(), "| devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu 0:", p.name, f"{p.total_memory / 2**30:.1f} GiB", "| uuid", p.uuid,
          "| nccl", torch.cuda.nccl.version())
else:
    print("WARNING: no CUDA: the GPU tests will be skipped")
import zmq
print("pyzmq", zmq.__version__, "libzmq", zmq.zmq_version(), zmq.__file__)
import monarch_kernel
print("monarch_kernel", monarch_kernel.__file__)
try:
    import pynvml
    pynvml.nvmlInit()
    print("NVML driver", pynvml.nvmlSystemGetDriverVersion())
except Exception as e:
    print("NVML:", type(e).__name__, e)
EOF
} 2>&1 | tee -a "$OUT/env.txt"

# ------------------------------------------------------------------ 3. tests
files=()
for f in tests/system/test_gpu.py tests/unit/test_buffer.py tests/unit/test_buffer_edges.py tests/unit/test_shm_recycle.py tests/unit/test_tensors.py tests/unit/test_actors.py tests/unit/test_peer_calls.py tests/unit/test_peer_lanes.py tests/unit/test_lane.py; do
    if [ -f "$f" ]; then files+=("$f"); else echo "(no $f: skipped)"; fi
done
t=$(( $(left) - BENCH_T - 10 ))
if [ "$t" -lt 30 ]; then t=30; fi
# one pytest process per file, in one time limit: a warning that a process prints
# as it exits (torch's "Producer process has been terminated before all shared
# CUDA tensors released") is then seen with its file
step "pytest ${files[*]}, one process each (limit ${t}s in all)" | tee "$OUT/pytest.log"
deadline=$(( SECONDS + t ))
junits=()
prc=0
for f in "${files[@]}"; do
    ft=$(( deadline - SECONDS ))
    if [ "$ft" -lt 10 ]; then echo "(no time left for $f)" | tee -a "$OUT/pytest.log"; prc=124; continue; fi
    j="/tmp/device_check_junit_$(basename "$f" .py).xml"
    junits+=("$j")
    echo "----- $f (limit ${ft}s)" | tee -a "$OUT/pytest.log"
    # shellcheck disable=SC2086  # PYTEST_X: empty or one word
    timeout -k 10 "$ft" "$PY" -m pytest -q -p no:cacheprovider $PYTEST_X --timeout 120 -rfEs \
        --durations=5 --junitxml="$j" "$f" 2>&1 | tee -a "$OUT/pytest.log"
    r=$?
    if [ "$r" -gt "$prc" ]; then prc=$r; fi
done
"$PY" - "$OUT/pytest-junit.xml" "${junits[@]}" <<'EOF' 2>&1 | tee -a "$OUT/pytest.log"
import os, sys
import xml.etree.ElementTree as ET
root = ET.Element("testsuites")
for path in sys.argv[2:]:
    if os.path.exists(path):
        for suite in ET.parse(path).getroot().iter("testsuite"):
            root.append(suite)
        os.remove(path)
ET.ElementTree(root).write(sys.argv[1])
print("junit:", len(root), "suites ->", sys.argv[1])
EOF
record pytest "$prc"

# -------------------------------------------------------------- 4. benchmark
t=$(( $(left) - 5 ))
if [ "$t" -lt 20 ]; then t=20; fi
step "benchmarks/gpu.py (limit ${t}s)" | tee "$OUT/gpu_bench.log"
# shellcheck disable=SC2086  # BENCH_ARGS: words on purpose
timeout -k 5 "$t" "$PY" -m benchmarks.gpu --json "$OUT/gpu_bench.json" ${BENCH_ARGS:-} 2>&1 \
    | tee -a "$OUT/gpu_bench.log"
record benchmark $?

# ------------------------------------------------- 5. the CPU suite, 16 cores
# the issue's CPU targets on a machine with more than 2 cores (no Jupyter here:
# no cells); fan-out to 64 workers
t=$(( CPU_BUDGET ))
if [ "$t" -gt 0 ]; then  # CPU_BUDGET=0: skip it
    step "python -m benchmarks --no-kernels --sizes 2,4,8 (limit ${t}s)" | tee "$OUT/cpu_bench.log"
    timeout -k 5 "$t" "$PY" -m benchmarks --no-kernels --sizes 2,4,8 \
        --json "$OUT/cpu_bench.json" 2>&1 | tee -a "$OUT/cpu_bench.log"
    record cpu_benchmark $?
fi

# ----------------------------------------------------------------- summary
sleep 1
{
    step "summary"
    printf '%s\n' "${summary[@]}"
    echo "exit status: $status (124: a step ran out of time)"
    echo "worker processes left: $(pgrep -f 'monarch_kernel[.]worker' | tr '\n' ' ')"
    echo "/dev/shm/monarch-* left: $(find /dev/shm -maxdepth 1 -name 'monarch-*' 2>/dev/null | wc -l)"
} 2>&1 | tee "$OUT/summary.txt"
exit "$status"
