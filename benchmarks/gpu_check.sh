#!/usr/bin/env bash
# One prepared check for a lent H200 (no network there). Its sections' time limits add up to 500 s, so
# with the wheel install it ends inside the 540 s call, whatever hangs. It writes
# JSON, PNG and logs (packed into $OUT on the device, see below; elsewhere: benchmarks/results/gpu).
#
# Through the device tool, from the repo root here (see docs/performance.md):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# .whl holds the wheels missing from the H200 image (deepspeed and what it needs, jsonargparse); build it
# with `bash benchmarks/gpu_wheels.sh`. DALI (~800 MB installed) is over the 64 MiB carry limit: its
# section is skipped there unless the image has it.
set -uo pipefail
cd "$(dirname "$0")/.."
# The device tool brings back at most 8 files from $OUT, and this check writes about 15 (a log per
# section, JSON + PNG per benchmark). So on the device everything goes to $RES and $OUT gets, after
# every section (a run killed at its limit still returns what it had): gpu_check.tar.gz with it all,
# plus status.txt and the benchmark JSONs to read without unpacking (6 at most: 8 files; environment.txt is in the
# archive).
if [[ -n "${OUT:-}" ]]; then RES=/tmp/gpu_check; else OUT=benchmarks/results/gpu RES=benchmarks/results/gpu; fi
mkdir -p "$OUT" "$RES"
pack() {
  [[ "$RES" == "$OUT" ]] && return
  tar czf "$OUT/gpu_check.tar.gz" -C "$RES" . && cp "$RES"/status.txt "$OUT"/ 2>/dev/null
  cp "$RES"/*.json "$OUT"/ 2>/dev/null
  return 0
}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
$PY - > "$RES/environment.txt" 2>&1 <<'PY'
import importlib, torch, lightning
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("lightning", lightning.__version__)
for name in ("deepspeed", "nvidia.dali", "transformer_engine", "pynvml", "jsonargparse"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "present"))
    except Exception as err:
        print(name, "missing:", err)
PY

: > "$RES/status.txt"
step() {  # step NAME SECONDS command...: each section is bounded and never stops the others
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1  # -k: SIGKILL 10 s after a SIGTERM is ignored
  echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$RES/status.txt"
  pack
}

# 1. fp32 eager vs bf16-mixed vs compiled on the tiny-GPT recipe's model (steps/s, MFU); fp8 (torchao
#    Float8Training, tensorwise, over bf16) eager and compiled where the GPU has fp8 (H100/H200: it does)
step precision_compile 105 $PY -m benchmarks.precision_compile --gpu --steps 60 --out "$RES"
# 2. the GPU-only tests: precision detection, ZeRO-2 preset, DALI mixed decode (skips say why)
step gpu_tests 80 $PY -m pytest -q -p no:cacheprovider tests/test_precision.py tests/monitor/test_utilization.py \
  "tests/monitor/test_goodput.py::test_gpu_kernels_are_charged_to_compute" \
  "tests/strategies/test_strategies.py::test_zero2_preset_trains_on_gpu" "tests/data/test_dali.py::test_gpu_mixed_decode" \
  "tests/checkpoint/test_cost.py::test_cuda_tensors_stage_into_pinned_buffers_without_blocking_the_host" \
  tests/test_float8.py
# 3. single-GPU strategies: plain vs accel_zero2 vs accel_fsdp
step strategies 55 $PY -m benchmarks.strategies_gpu --steps 40 --out "$RES"
# 4. checkpoint cost end to end from GPU memory (pinned staging): ours sync/async vs Lightning's AsyncCheckpointIO
#    and torch DCP async_save, 50M parameters with momentum (a 400 MB checkpoint), 30 steps, a save every 10
step checkpoint 45 $PY -m benchmarks.checkpoint_async --gpu --params-m 50 --steps 30 --every 10 --rounds 1 --out "$RES"
# 5. DALI mixed decode vs CPU backend vs torch DataLoader (only where DALI is installed)
#    Its 40 s are section 12's where DALI is missing (always so far: it is too large to carry), else 12 is skipped.
if $PY -c "import nvidia.dali" 2>/dev/null; then
  step dataloading 40 $PY -m benchmarks.dataloading --gpu --images 512 --workers 8 --rounds 3 --out "$RES"
  OBJECT_STORAGE_S=0
else
  echo "dataloading skipped: nvidia-dali-cuda120 is not installed on this machine" | tee -a "$RES/status.txt"
  OBJECT_STORAGE_S=40
fi
# 6. the goodput ledger on a GPU (CUDA-synchronized buckets) beside Lightning's ThroughputMonitor
step goodput 30 $PY -m benchmarks.goodput_attribution --gpu --steps 100 --rounds 1 --out "$RES"
# 7. the doctor's GPU-only findings (sync stalls, pageable copies, idle time via HolisticTraceAnalysis,
#    precision, memory headroom), then `lightning-accel profile` on the GPU recipe (traces stay on the device)
step doctor 40 bash -c "$PY -m pytest -q -p no:cacheprovider \
  tests/profile/test_doctor.py::test_gpu_doctor_measures_syncs_pageable_copies_and_idle_time \
  && COLUMNS=200 $PY -m lightning_accel.cli profile --config recipes/tiny_gpt_gpu.yaml --out /tmp/profile_gpu \
     --wait 10 --active 3 --trainer.enable_progress_bar false \
  && mkdir -p $RES/profile && cp /tmp/profile_gpu/doctor.* /tmp/profile_gpu/profile/profile_summary.json $RES/profile/"
# 8. tune on the GPU recipe: precisions incl. 16-mixed (and fp8 where Transformer Engine is there), compile
#    modes, pinned memory, the batch up to the memory limit (a short budget: a smoke run of the search)
step tune 30 $PY -m lightning_accel.cli tune --config recipes/tiny_gpt_gpu.yaml --budget 25s --measure-s 1 \
  --out "$RES/tune/tuned.yaml"
# 9. activation checkpointing on the GPU: CUDA's peak allocation vs step time, none / full / selective
step activation_checkpointing 25 $PY -m benchmarks.activation_checkpointing --gpu --rounds 1 --steps 8 --out "$RES"
# 10. the hang sentinel on one GPU with NCCL: a rank stuck in training_step exits 76 with its stacks and NCCL's
#     flight recorder dumped (2-rank detection and stragglers are covered on CPU; one GPU cannot hold 2 NCCL ranks)
step hang_sentinel 20 $PY -m pytest -q -p no:cacheprovider \
  "tests/monitor/test_sentinel.py::test_on_a_gpu_the_nccl_flight_recorder_is_dumped_beside_the_stacks"
# 11. accel_zero2 with accumulation on one GPU steps as DDP does (the loss divided once, not twice)
step zero_steps_as_ddp 30 $PY -m pytest -q -p no:cacheprovider \
  "tests/checkpoint/test_world_change.py::test_the_accel_zero2_preset_on_one_gpu_steps_as_ddp_does_with_accumulation"
# 12. checkpoints to a bucket with training on the GPU (issue #42's ratio, where the host's cores are not all taken by
#     training as on the 2-core CI machine): fit time ours vs Lightning's ModelCheckpoint("s3://") sync and async and
#     DCP async_save, against moto's S3 server on this host (carried wheels), no network model in between
if (( OBJECT_STORAGE_S > 0 )); then
  step object_storage $OBJECT_STORAGE_S $PY -m benchmarks.object_storage --gpu --rounds 2 --links local --out "$RES"
else
  echo "object_storage skipped: the DALI section took its 40 s of the 540 s call" | tee -a "$RES/status.txt"
fi
pack
echo "== gpu_check summary =="; cat "$RES/status.txt"
