#!/usr/bin/env bash
# The answer in seconds on one H200 (issue "the answer in seconds"): topology=auto's choice, the
# default run, the headline and a CP job at world size 1, each run twice (the second warm).
#   bash experiments/run_time/answer.sh OUT [PHASE...]   (from the repository root; wheels in .whl/)
# PHASE: auto_window auto_window_all auto_documents auto_documents_all runs (default: all).
#   auto_window     window(1024) 128K, P=8 simulated: asked, asked again (the kept answer), and
#                   asked afresh with the compile caches the first ask warmed (reuse=false)
#   auto_window_all the same with every candidate timed (options.shortlist=0, reuse=false): the
#                   pick's time against the best timed one
#   auto_documents[_all]  the same on four documents of 32K
#   runs            the default run, the headline (causal B4 H16 8K D128, tuned) and ring /
#                   all-gather / Ulysses at world size 1, 64K, each twice (RUNS=1: once, on a
#                   machine whose compile caches earlier phases or calls have warmed)
#   one_device      (not in the default list) the default run and the headline, each twice
#   bytecode        (not in the default list) what keeping compiled bytecode between runs is
#                   worth here: torch's import, twice with and without writing it
#   profiles        (not in the default list) the default run, the headline and the ring at
#                   world size 1 once more, each with a cProfile of its Python
#                   (run_profile.txt): where the seconds of a warm run go
set -u
OUT=${1:?usage: answer.sh OUT [PHASE...]}; shift || true
WHAT=" ${*:-auto_window auto_window_all auto_documents auto_documents_all runs} "
mkdir -p "$OUT" && W=$(mktemp -d) && source experiments/gpu_env.sh
export PYTHONPATH=/tmp/site:$PWD ATTNGYM_PROGRESS=0
python3 -c "import attngym.conf" 2>/dev/null || ln -sfn "$PWD/conf" attngym/conf
has() { [[ $WHAT == *" $1 "* ]]; }
AG="python3 -m attngym logger=none"
# The asks are judged by auto_s (the choice): no torch_cp beside the pick, which took 70-96 s of
# each run on an H100 (2026-12-05), so that every phase fits one device call.
AUTO="topology=auto topology.simulate=true topology.world_size=8 shape.batch=1 shape.heads=8 shape.head_dim=128 shape.seq_len=131072 validate=false baselines=[]"
ask() {  # NAME OVERRIDES...: asked, asked again (the kept answer), asked afresh (warm caches)
  local name=$1; shift
  T_TIMEOUT=200 t "${name}_1" $AG $AUTO "$@" hydra.run.dir="${name}_1"
  T_TIMEOUT=100 t "${name}_2" $AG $AUTO "$@" hydra.run.dir="${name}_2"
  T_TIMEOUT=150 t "${name}_warm" $AG $AUTO "$@" topology.options.reuse=false hydra.run.dir="${name}_warm"
  cp "$W/${name}_1/auto.json" "$OUT/${name}_1.auto.json" 2>/dev/null
}
every() {  # NAME OVERRIDES...: every candidate timed
  local name=$1; shift
  T_TIMEOUT=280 t "${name}_all" $AG $AUTO "$@" topology.options.shortlist=0 \
    topology.options.reuse=false hydra.run.dir="${name}_all"
  cp "$W/${name}_all/auto.json" "$OUT/${name}_all.auto.json" 2>/dev/null
}
WINDOW="attention=sliding_window ++attention.window_size=1024"
DOCS="attention=document ++attention.doc_lengths=[32768,32768,32768,32768]"
has auto_window && ask auto_window $WINDOW
has auto_window_all && every auto_window $WINDOW
has auto_documents && ask auto_documents $DOCS
has auto_documents_all && every auto_documents $DOCS
if has runs; then
  for i in $(seq ${RUNS:-2}); do
    t "default$i" $AG hydra.run.dir="default$i"
    t "headline$i" $AG attention=causal shape.batch=4 shape.heads=16 shape.seq_len=8192 \
      shape.head_dim=128 block_size=tuned hydra.run.dir="headline$i"
    for s in ring allgather ulysses; do
      t "cp_${s}_$i" $AG topology=$s topology.world_size=1 attention=sliding_window \
        ++attention.window_size=1024 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 \
        hydra.run.dir="cp_${s}_$i"
    done
  done
fi
if has one_device; then
  for i in 1 2; do
    t "default$i" $AG hydra.run.dir="default$i"
    t "headline$i" $AG attention=causal shape.batch=4 shape.heads=16 shape.seq_len=8192 \
      shape.head_dim=128 block_size=tuned hydra.run.dir="headline$i"
  done
fi
if has bytecode; then
  { env | grep '^PYTHON' | grep -v '^PYTHONPATH'
    python3 -c 'import sys; print("dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)'
    IMPORT='import torch, torch._dynamo, torch._inductor.lowering'
    for how in prefix_no_writes no_prefix_no_writes prefix_writes; do
      for i in 1 2; do
        s=$(date +%s.%N)
        case $how in
          prefix_no_writes) env PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=/tmp/pyc_a python3 -c "$IMPORT" ;;
          no_prefix_no_writes) env -u PYTHONPYCACHEPREFIX PYTHONDONTWRITEBYTECODE=1 python3 -c "$IMPORT" ;;
          prefix_writes) env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc_b python3 -c "$IMPORT" ;;
        esac
        echo "$how, import $i: $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
      done
    done
    du -sh /tmp/pyc_a /tmp/pyc_b 2>&1; } > "$OUT/bytecode.txt" 2>&1
fi
if has profiles; then
  t default_profile $AG profile_run=true hydra.run.dir=default_profile
  t headline_profile $AG attention=causal shape.batch=4 shape.heads=16 shape.seq_len=8192 \
    shape.head_dim=128 block_size=tuned profile_run=true hydra.run.dir=headline_profile
  t cp_ring_profile $AG topology=ring topology.world_size=1 attention=sliding_window \
    ++attention.window_size=1024 shape.seq_len=65536 shape.heads=8 shape.head_dim=128 \
    profile_run=true hydra.run.dir=cp_ring_profile
  for d in default_profile headline_profile cp_ring_profile; do cp "$W/$d/run_profile.txt" "$OUT/$d.txt" 2>/dev/null; done
fi
for d in "$W"/*/; do [ -f "$d/metrics.json" ] && cp "$d/metrics.json" "$OUT/$(basename "$d").metrics.json"; done
python3 - "$OUT" <<'PY' | tee "$OUT/answer.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.metrics.json")):
    m = json.loads(f.read_text())
    keys = ("status", "validation", "wall_s", "auto_s", "auto_pick", "auto_pick_ms", "auto_timed",
            "auto_candidates", "auto_cached")
    phases = {k[6:-2]: round(v, 1) for k, v in m.items() if k.startswith("phase_") and v}
    print(f.name.split(".")[0], {k: m.get(k) for k in keys if m.get(k) is not None}, phases)
for name in ("auto_window", "auto_documents"):
    try:
        first = json.loads((out / f"{name}_1.metrics.json").read_text())
        every = json.loads((out / f"{name}_all.auto.json").read_text())["candidates"]
    except (OSError, KeyError, ValueError):
        continue
    best = min(c["timed_ms"] for c in every if c["timed_ms"] is not None)
    print(f"{name}: pick {first['auto_pick_ms']:.3f} ms against the best of every candidate timed "
          f"{best:.3f} ms: {first['auto_pick_ms'] / best - 1:+.1%}")
PY
tar -C "$OUT" -czf /tmp/answer.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/answer.tgz "$OUT/"
