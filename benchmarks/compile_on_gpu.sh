#!/usr/bin/env bash
# Issue 28's device step in one call: compiled blocks beside eager ones on tnlg-1.3b, most wanted first.
#
#     bash benchmarks/compile_on_gpu.sh [SECONDS [--smoke]]   # SECONDS of the call (default 540)
#
# (--smoke, with TRITON_INTERPRET=1 and a large SECONDS, rehearses it on a CPU: the debug preset.)
#
# A lease is 15 minutes, the machine's start included, and a machine left idle for 30 s goes back, so the
# parts run in one call rather than one call each. Each part starts only when the seconds it took on the
# H100 (plus a margin) are still left, and is stopped when the call's time runs out, so that a slow part
# costs the ones after it and not the figures before it. Every part writes its whole output under $OUT;
# the last lines printed are the tables, which the reply carries. Exits 1 when a part failed or ran out
# of time. CI rehearses it on the CPU (.ci/rehearse_device).
#
# Order: the goal's figure (the preset's activation checkpointing, torch's default mode); then CUDA graphs
# (stage 0; stage 3 refuses them), the step's host launches being what the earlier profile blamed; then
# checkpointing off; inductor choosing the GEMMs by measuring them; one profiled step. Inductor's cache is
# cold in the first part only: later parts compile from what the earlier ones left.
set -uo pipefail
budget=${1:-540}
extra=("${@:2}")  # --smoke or nothing
start=$(date +%s)
out=${OUT:-$(mktemp -d)}
failed=0
export PYTHONUNBUFFERED=1

left() { echo $((budget - ($(date +%s) - start))); }

part() {  # name, seconds it needs, command...: runs the command if that many seconds are left
  local name=$1 needs=$2
  shift 2
  if [ "$(left)" -lt "$needs" ]; then
    echo "== $name: not run, $(left) s left of the $needs it needs" | tee -a "$out/summary.txt"
    return
  fi
  echo "== $name: $* ($(left) s left)" | tee -a "$out/summary.txt"
  local began=$(date +%s)
  timeout --kill-after=5 "$(($(left) - 3))" "$@" > "$out/$name.txt" 2>> "$out/stderr.log"
  local status=$?
  [ "$status" -eq 0 ] || failed=1  # the later parts still run; the call's exit status says so
  # The variants' rows (gate, then timing), the ratios, and whatever went wrong; the profile's totals.
  grep -E "^\| tnlg stage|compiled / eager|left out|compiled during|MISMATCH|No timing|^step wall|^device idle|^compilations|Error" \
    "$out/$name.txt" >> "$out/summary.txt"
  echo "   exit $status after $(($(date +%s) - began)) s" | tee -a "$out/summary.txt"
}

python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
python3 - << 'EOF' | tee "$out/summary.txt"
import torch, transformers, triton
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"{device}: torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}")
EOF

part checkpointing_on 190 python3 -m benchmarks.side_by_side --compile on "${extra[@]}"
# Inductor logs each graph it could not record (and falls back to launching kernels one by one) only here.
TORCH_LOGS=cudagraphs part cuda_graphs 190 python3 -m benchmarks.side_by_side --compile on --compile-mode reduce-overhead "${extra[@]}"
grep -ciE "skipping cudagraphs|re-recording" "$out/stderr.log" | sed 's/^/   cudagraphs skip or re-record lines: /' | tee -a "$out/summary.txt"
part checkpointing_off 120 python3 -m benchmarks.side_by_side --compile on --activation-checkpointing off "${extra[@]}"
# On the H100 its autotuning took over 250 s (15 GEMM shapes, 21 choices each), and chose cuBLAS for all.
part max_autotune 330 python3 -m benchmarks.side_by_side --compile on --compile-mode max-autotune-no-cudagraphs "${extra[@]}"
part profile 110 python3 -m benchmarks.profile_step --compile on "${extra[@]}"
echo
cat "$out/summary.txt"
exit "$failed"
