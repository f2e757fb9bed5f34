# Sourced from the repository root by the GPU experiments' run.sh: the settings of the lent H200
# (no NVLink multicast), attngym and its wheels from .whl/ where the machine has no network
# (Hydra, OmegaConf, wandb, attngym's own), and `t NAME COMMAND...`, which runs a command in $W
# with a timeout (T_TIMEOUT, default 300 s, cut to end 20 s before the epoch second T_DEADLINE
# where that is set, so that a call cut by the machine's limit still copies what finished) into
# $OUT/NAME.log and notes its exit code and wall time in $OUT/summary.txt; `readme_masks DIR`
# writes the Quick start's mymasks.py into DIR.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc
# Compiled bytecode kept between runs in /tmp/pyc, as an installed Python keeps it next to its
# sources: the image of the GPU machines these experiments ran on sets PYTHONDONTWRITEBYTECODE=1
# and its site-packages hold no bytecode, so every run compiled the modules it imports again
# (torch's import 12-14 s, against 5.5 s with bytecode kept; one H100, 2026-12-07:
# experiments/run_time, "An eighth time").
unset PYTHONDONTWRITEBYTECODE
# The GPU tests' timeouts are pytest-timeout's marks: without the plugin a hung test holds its
# phase to the phase's own limit (tests_ulysses, 420 s on 2026-12-07).
python3 -c "import pytest_timeout" 2>/dev/null ||
  echo "pytest-timeout is not installed: its wheel belongs in .whl/ (a hung GPU test hangs its phase)" | tee -a "$OUT/summary.txt" >&2
# The CuTe DSL (FLASH) puts its packages on sys.path from a .pth file, which PYTHONPATH skips.
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
t() {
  local name=$1; shift
  local s=$(date +%s.%N) limit=${T_TIMEOUT:-300}
  if [ -n "${T_DEADLINE:-}" ]; then
    local left=$((T_DEADLINE - $(date +%s) - 20))
    ((left < limit)) && limit=$left
    ((limit > 0)) || { echo "$name skipped: past T_DEADLINE" | tee -a "$OUT/summary.txt"; return; }
  fi
  ( cd "$W" && timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 )
  local rc=$?
  echo "$name rc=$rc wall_s=$(python3 -c "print(round($(date +%s.%N)-$s,1))")" | tee -a "$OUT/summary.txt"
}
readme_masks() {  # the Quick start's mymasks.py, as the README writes it, into folder $1
  python3 - "$PWD/README.md" > "$1/mymasks.py" <<'PY'
import re, sys
text = open(sys.argv[1]).read().split("## Quick start", 1)[1]
print(re.search(r"cat > mymasks.py <<'PY'\n(.*?)\nPY\n", text, re.DOTALL)[1])
PY
}
