#!/usr/bin/env bash
# Runs on the GPU machine: installs the vLLM 0.26 kit, then the chosen benchmark plan.
# Usage (from the repo root, via the device tool):  bash benchmarks/gpu/run.sh PLAN
#   PLAN: smoke | validate | full | tp2 | v30sleep | v46a | v46b | ...
set -uo pipefail
plan=${1:-smoke}
if [ "${2:-}" != "--no-install" ]; then source .gpu/install.sh || exit 3; fi
# Wheels the image lacks, if the runner put any in .gpu/extra (none are needed today).
if compgen -G ".gpu/extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/extra/*.whl || exit 4
fi
# The repo root too: the null-sink baseline connector is benchmarks.null_sink.
export PYTHONPATH=$PWD/packages/reader/src:$PWD/packages/connector/src:$PWD:${PYTHONPATH:-}
# The packages run from the checkout (not pip-installed): declare the connector's vLLM
# plugin entry point (pyproject.toml) so vLLM loads it in every process, as after a pip
# install. Forward capture needs it (engine/forward/install.py).
dist=/tmp/site/hidden_state_connector-0.1.0.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: hidden-state-connector\nVersion: 0.1.0\n' >"$dist/METADATA"
printf '[vllm.general_plugins]\nhidden_state_connector = hidden_state_connector.plugin:register\n' \
  >"$dist/entry_points.txt"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The reader's native fp8 kernel (the image has a C compiler; without it the reader uses
# torch passes and says so).
(cd packages/reader && python3 setup.py -q build_ext --inplace) >"$OUT/build.log" 2>&1
python3 -c "from hidden_state_reader.kernels.fp8_cpu import kernel; print('fp8 CPU kernel:', kernel())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp /dev/shm | tail -2
B="python3 benchmarks/gpu/bench.py"
# py-spy from its wheel in .gpu/extra (a static binary; pip --target drops it): its path,
# once it has shown it can read a Python process here (ptrace may be refused).
pyspy_binary() {
  python3 - <<'PY' || return 1
import glob, os, subprocess, sys, zipfile
wheels = glob.glob(".gpu/extra/py_spy-*.whl")
if not wheels:
    sys.exit(1)
with zipfile.ZipFile(wheels[0]) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/py-spy"))
    open("/tmp/py-spy", "wb").write(z.read(name))
os.chmod("/tmp/py-spy", 0o755)
probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
said = subprocess.run(["/tmp/py-spy", "dump", "--pid", str(probe.pid)], capture_output=True, text=True)
probe.kill()
print("/tmp/py-spy" if said.returncode == 0 else "", end="")
sys.stderr.write(f"py-spy dump: rc {said.returncode} {said.stderr[-300:]}\n")
PY
}
case "$plan" in
  smoke)
    $B validate --dtype float32 2>&1 | tail -5 | tee "$OUT/validate_fp32.txt"
    $B validate --dtype bfloat16 2>&1 | tail -3 | tee "$OUT/validate_bf16.txt"
    $B throughput --num-prompts 64 --storages /tmp --graph-modes eager --json "$OUT/smoke.json" 2>&1 | tail -30
    ;;
  validate)
    for g in "" "--graphs"; do
      $B validate --dtype float32 $g 2>&1 | grep RESULT
      $B validate --dtype bfloat16 $g 2>&1 | grep RESULT
    done | tee "$OUT/validate.txt"
    ;;
  full)
    $B throughput --num-prompts 512 --storages /tmp,/dev/shm --graph-modes eager,graphs --json "$OUT/throughput.json" 2>&1 | tail -40
    $B long --json "$OUT/long.json" 2>&1 | tail -12
    ;;
  lean)
    $B throughput --num-prompts 256 --storages /tmp --graph-modes eager --json "$OUT/throughput.json" 2>&1 | grep -v WARNING | tail -12
    $B long --long-len 32768 --json "$OUT/long.json" 2>&1 | grep -v WARNING | tail -8
    ;;
  final)
    $B long --kinds ours --json "$OUT/long.json" 2>&1 | grep -v WARNING | tail -4
    $B throughput --kinds ours --num-prompts 256 --storages /tmp --graph-modes eager --json "$OUT/throughput.json" 2>&1 | grep -v WARNING | tail -4
    $B long --kinds example --json "$OUT/long.json" 2>&1 | grep -v WARNING | tail -4
    ;;
  # Issue 14 (2026-12-01): fp8 storage on CUDA (quantized on the side stream before the
  # device-to-host copy): values vs HF within the fp8 bound, then throughput bf16 vs fp8.
  v14a)
    for conn in '{}' '{"storage_dtype": "fp8_e4m3"}'; do
      timeout 200 $B validate --dtype bfloat16 --connector "$conn" 2>>"$OUT/v14a.log" \
        | grep RESULT | sed 's/^RESULT //' | tee -a "$OUT/results.jsonl"
    done
    ;;
  v14b)
    for conn in '{}' '{"storage_dtype": "fp8_e4m3"}' '{}' '{"storage_dtype": "fp8_e4m3"}'; do
      $B throughput --num-prompts 256 --kinds ours --timeout 200 --connector "$conn" \
        --json "$OUT/t.json" 2>>"$OUT/v14b.log" | tail -3
    done
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # Issue 12 (2026-12-01): three calls of < 10 minutes; every RESULT line goes to
  # $OUT/results.jsonl as soon as it exists.
  v12a)  # validation: values vs HF, chunked prefill, prefix caching, output tokens, CRC
    for cfg in "float32 " "bfloat16 " "bfloat16 --graphs" "float32 --graphs"; do
      set -- $cfg
      timeout 170 $B validate --dtype "$1" ${2:-} 2>"$OUT/validate-$1${2:-}.log" | grep RESULT \
        | sed 's/^RESULT //' | tee -a "$OUT/results.jsonl"
    done
    ;;
  v12b)  # throughput + lock release, eager (interleaved, 2 repeats) and graphs (1)
    $B throughput --num-prompts 256 --kinds none,example,ours --repeats 1 --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v12b.log" | tail -8
    $B throughput --num-prompts 256 --kinds example,ours --repeats 1 --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v12b.log" | tail -5
    $B throughput --num-prompts 256 --kinds example,ours --graph-modes graphs --timeout 240 \
      --json "$OUT/t.json" 2>>"$OUT/v12b.log" | tail -5
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v12c)  # graphs repeat + no-extraction baseline, 32k-token requests, /dev/shm once
    $B throughput --num-prompts 256 --kinds example,ours,none --graph-modes graphs \
      --timeout 240 --json "$OUT/t.json" 2>>"$OUT/v12c.log" | tail -6
    $B long --kinds example,ours --timeout 240 --json "$OUT/t.json" 2>>"$OUT/v12c.log" | tail -4
    $B throughput --num-prompts 256 --kinds ours --storages /dev/shm --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v12c.log" | tail -3
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v12d)  # after the in-order copy fix: ours eager + graphs, then 32k-token requests
    $B throughput --num-prompts 256 --kinds ours --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v12d.log" | tail -3
    $B throughput --num-prompts 256 --kinds ours,none --graph-modes graphs --timeout 240 \
      --json "$OUT/t.json" 2>>"$OUT/v12d.log" | tail -4
    $B long --kinds example,ours --timeout 200 --json "$OUT/t.json" 2>>"$OUT/v12d.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # Issue 24 (2026-12-02). Every RESULT line goes to $OUT/results.jsonl as it exists.
  v24a)  # eager: none / example / ours (CRC on, the new default) interleaved twice; then
         # 32k-token requests, multiprocess, device memory from nvidia-smi
    $B throughput --num-prompts 256 --kinds none,example,ours --repeats 2 --timeout 150 \
      --connector '{"checksum": true}' --json "$OUT/t.json" 2>>"$OUT/v24a.log" | tail -8
    $B long --kinds example,ours --long-multiprocess --timeout 150 \
      --json "$OUT/t.json" 2>>"$OUT/v24a.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v24b)  # CUDA graphs: none / example / ours (CRC on) interleaved twice
    $B throughput --num-prompts 256 --kinds none,example,ours --repeats 2 --graph-modes graphs \
      --timeout 170 --connector '{"checksum": true}' --json "$OUT/t.json" 2>>"$OUT/v24b.log" | tail -8
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v24d)  # decode-heavy (512-token prompts, 256 generated): none / null sink / ours
    $B throughput --num-prompts 256 --prompt-len 512 --max-tokens 256 --max-model-len 1024 \
      --kinds none,null,ours --timeout 150 --json "$OUT/t.json" 2>>"$OUT/v24d.log" | tail -5
    # 32k again, device memory counted from the engine's reservation (before the warm-up)
    $B long --kinds example,ours --long-multiprocess --timeout 150 \
      --json "$OUT/t.json" 2>>"$OUT/v24d.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # Issue 28 (next): the trainer's feed with one shape per step (5 samples per pack fill
  # nearly every pack to 16,384 tokens), so rows compare with the resident batch alone.
  v28)
    timeout 500 python3 benchmarks/gpu/train_feed.py --batch-samples 5 --seconds 10 \
      --alone-seconds 5 --unique 32 --copies 10 --jsonl "$OUT/results.jsonl" \
      --rows synthetic,synthetic_varlen,hsl_bf16_static,hsl_fp8_static,hsl_bf16_follow,hsl_fp8_follow,dl_bf16_static,safetensors_bf16,hsl_bf16_static_alone,hsl_fp8_static_alone,synthetic \
      2>"$OUT/v28.log" | grep RESULT
    ;;
  v24c)  # sustained: engine + 3 follow/claim/delete readers; none first, bf16 >= 100 GB, fp8
    S="python3 benchmarks/gpu/sustain.py --jsonl $OUT/results.jsonl"
    timeout 120 $S --kind none --batches 4 2>>"$OUT/v24c.log" | tail -1
    timeout 240 $S --kind ours --target-gb 100 2>>"$OUT/v24c.log" | tail -1
    timeout 150 $S --kind ours --batches 6 --connector '{"storage_dtype": "fp8_e4m3"}' \
      2>>"$OUT/v24c.log" | tail -1
    timeout 120 $S --kind ours --batches 4 --connector '{"storage_dtype": "fp8_e4m3"}' \
      --reader-device cuda 2>>"$OUT/v24c.log" | tail -1
    ;;
  # Issue 24 (2026-12-04): fp8 storage read with the native CPU kernel (default reader
  # options) and with device="cuda", against no extraction in the same call.
  v24e)
    S="python3 benchmarks/gpu/sustain.py --jsonl $OUT/results.jsonl"
    timeout 110 $S --kind none --batches 4 2>>"$OUT/v24e.log" | tail -1
    timeout 150 $S --kind ours --batches 6 --connector '{"storage_dtype": "fp8_e4m3"}' \
      2>>"$OUT/v24e.log" | tail -1
    timeout 130 $S --kind ours --batches 4 --connector '{"storage_dtype": "fp8_e4m3"}' \
      --reader-device cuda 2>>"$OUT/v24e.log" | tail -1
    ;;
  v24f)  # decode-heavy again (512-token prompts, 256 generated): none / null sink / ours
    $B throughput --num-prompts 256 --prompt-len 512 --max-tokens 256 --max-model-len 1024 \
      --kinds ours,null,none --timeout 150 --json "$OUT/t.json" 2>>"$OUT/v24f.log" | tail -5
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v24g)  # the fp8 sustained rows again, in reverse order: device="cuda", none, CPU kernel
    S="python3 benchmarks/gpu/sustain.py --jsonl $OUT/results.jsonl"
    timeout 150 $S --kind ours --batches 4 --connector '{"storage_dtype": "fp8_e4m3"}' \
      --reader-device cuda 2>>"$OUT/v24g.log" | tail -1
    timeout 110 $S --kind none --batches 4 2>>"$OUT/v24g.log" | tail -1
    timeout 150 $S --kind ours --batches 6 --connector '{"storage_dtype": "fp8_e4m3"}' \
      2>>"$OUT/v24g.log" | tail -1
    ;;
  # Issue 30 (2026-12-04): sleep mode. One engine (tiny bf16 model, enable_sleep_mode),
  # three rounds of generate -> sleep(level=1) -> wake_up, every answered sample read back
  # (CRC) and compared with HF; one RESULT line (kind "sleep") in $OUT/results.jsonl.
  v30sleep)
    timeout 170 python3 benchmarks/gpu/sleep_check.py --jsonl "$OUT/results.jsonl" \
      2>>"$OUT/v30sleep.log" | grep RESULT
    ;;
  # Issue 35: the correctness sweep every change to the connector's engine path runs on a
  # GPU before it lands (benchmarks/gpu/verify.py; one call, < 9 minutes).
  verify)
    timeout 520 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" \
      2>"$OUT/verify.log" | cut -c1-1500
    ;;
  # Issue 36: forward capture on CUDA. v36a: the correctness sweep for the forward engine
  # (eager and CUDA graphs, sync and async scheduling), one extract engine as reference.
  v36a)
    timeout 420 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --configs \
"capture=forward,pc=off,graphs=off,storage=bf16,sleep=on,async=off;\
capture=forward,pc=off,graphs=on,storage=fp8,sleep=off,async=off;\
capture=forward,pc=off,graphs=on,storage=bf16,sleep=off;\
capture=extract,pc=off,graphs=on,storage=bf16,sleep=off,async=off" \
      2>"$OUT/v36a.log" | cut -c1-1500
    ;;
  # v36b/v36c: throughput, no extraction / forward / extract interleaved, CUDA graphs, the
  # 8B-shaped model (dummy weights); prefill-heavy (1024-token prompts, 1 generated) and
  # decode-heavy (512-token prompts, 256 generated). KV capacity is in every row.
  v36b)
    $B throughput --num-prompts 256 --kinds none,forward,ours --graph-modes graphs \
      --timeout 170 --json "$OUT/t.json" 2>>"$OUT/v36b.log" | tail -5
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v36c)
    $B throughput --num-prompts 256 --prompt-len 512 --max-tokens 256 --max-model-len 1024 \
      --kinds none,forward,ours --graph-modes graphs --timeout 170 --json "$OUT/t.json" \
      2>>"$OUT/v36c.log" | tail -5
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # Issue 37: the device feed as stages. The fork check, then the feed rows that cover
  # each stage (no vLLM needed: run with --no-install).
  v37)
    (cd /tmp && python3 -X faulthandler "$OLDPWD/benchmarks/gpu/fork_check.py") 2>&1 \
      | tee "$OUT/fork.log" | grep -v "^\s*File\|^  " | tail -6
    grep RESULT "$OUT/fork.log" | sed 's/^RESULT //' >> "$OUT/results.jsonl"
    timeout 300 python3 benchmarks/gpu/train_feed.py --batch-samples 5 --seconds 10 \
      --alone-seconds 5 --unique 32 --copies 10 --jsonl "$OUT/results.jsonl" \
      --rows synthetic,hsl_bf16_static,hsl_fp8_static,hsl_bf16_follow,dl_bf16_static,synthetic \
      2>"$OUT/v37.log" | grep RESULT | cut -c1-400
    ;;
  v36d)  # after vectorising the ingest: decode-heavy, then prefill-heavy; none / forward
    $B throughput --num-prompts 256 --prompt-len 512 --max-tokens 256 --max-model-len 1024 \
      --kinds forward,none --graph-modes graphs --timeout 150 --json "$OUT/t.json" \
      2>>"$OUT/v36d.log" | tail -3
    $B throughput --num-prompts 256 --kinds none,forward --graph-modes graphs \
      --timeout 150 --json "$OUT/t.json" 2>>"$OUT/v36d.log" | tail -3
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  v36e)  # the sweep again for the final forward code (vectorised ingest): two engines
    timeout 190 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --configs \
"capture=forward,pc=off,graphs=on,storage=bf16,sleep=off;\
capture=forward,pc=off,graphs=off,storage=fp8,sleep=on,async=off" \
      2>"$OUT/v36e.log" | cut -c1-700
    ;;
  # Issue 44: forward capture under vLLM's defaults: prefix caching on (shared prefixes,
  # repeated prompts: hits in the same step), async scheduling (vLLM's default), CUDA
  # graphs, fp8, sleep/wake; three engines at once, 768 requests (one call, < 9 minutes).
  v44a)
    timeout 500 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 256 \
      --label v44a --configs \
"capture=forward,pc=on,graphs=on,storage=bf16,sleep=off;\
capture=forward,pc=on,graphs=off,storage=fp8,sleep=on,async=off;\
capture=forward,pc=on,graphs=on,storage=bf16,sleep=off,async=off" \
      2>"$OUT/v44a.log" | cut -c1-900
    ;;
  # Issues 43-45: the sweep again for the code after the engine seam, the deferred arena
  # copy and the scheduler's skip of settled requests: two engines, 512 requests, every
  # row against HF float32 (prefix caching, async or sync scheduling, graphs, fp8, sleep).
  v44d)
    timeout 540 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 256 \
      --label v44d --configs \
"capture=forward,pc=on,graphs=on,storage=bf16,sleep=off;\
capture=forward,pc=on,graphs=off,storage=fp8,sleep=on,async=off" \
      2>"$OUT/v44d.log" | cut -c1-900
    ;;
  # Issue 44: the MoE and MLA families on CUDA with forward capture (Triton fused MoE,
  # Triton MLA), float32 (crisp values) and bf16, prefix caching on, eager.
  v44b)
    python3 .gpu/check_moe.py 2>&1 | tail -3
    timeout 480 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 64 \
      --rounds 1 --parallel 6 --label v44b --configs \
"capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe,dtype=float32;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=gpt_oss,dtype=float32;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=deepseek_v2,dtype=float32;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=gpt_oss;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=deepseek_v2" \
      2>"$OUT/v44b.log" | cut -c1-900
    ;;
  # Issue 44: the same MoE engines with the extract engine (vLLM's own hidden-state path):
  # the same wrong tokens would be vLLM's numerics against HF, not the forward capture.
  v44c)
    timeout 400 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 64 \
      --rounds 1 --label v44c --configs \
"capture=extract,pc=on,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe,dtype=float32;\
capture=extract,pc=on,graphs=off,storage=bf16,sleep=off,arch=gpt_oss,dtype=float32;\
capture=forward,pc=off,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe,dtype=float32" \
      2>"$OUT/v44c.log" | cut -c1-1200
    ;;
  # Issue 44, after the worker's let-go signal (RowsLetGo): the sweep's two engines, 32k-token
  # prompts against a 40 MiB arena (fewer than two prompts' rows: requests wait for room),
  # and beside them the MoE families in float32 with Triton's float32 dots in IEEE
  # precision (TRITON_F32_DEFAULT: the fused MoE's TF32 rounding made rows differ from HF
  # float32 at router near-ties, in the extract engine too) and in bf16.
  v44e)
    python3 .gpu/check_moe.py 2>&1 | tail -2
    TRITON_F32_DEFAULT=ieee timeout 470 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" \
      --requests 64 --rounds 1 --label v44e --configs \
"capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe,dtype=float32;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=gpt_oss,dtype=float32;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=qwen3_moe;\
capture=forward,pc=on,graphs=off,storage=bf16,sleep=off,arch=gpt_oss" \
      2>"$OUT/v44e-moe.log" | cut -c1-900 &
    timeout 480 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 8 \
      --rounds 1 --label v44e --work /tmp/hs-verify-long --configs \
"capture=forward,pc=on,graphs=on,storage=bf16,sleep=off,long=32768,arena=40MiB" \
      2>"$OUT/v44e-long.log" | cut -c1-900 &
    timeout 480 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --requests 256 \
      --label v44e --configs \
"capture=forward,pc=on,graphs=on,storage=bf16,sleep=off;\
capture=forward,pc=on,graphs=off,storage=fp8,sleep=on,async=off" \
      2>"$OUT/v44e.log" | cut -c1-900
    wait
    ;;
  # Issue 38: forked DataLoader workers after device passes (no vLLM; about a minute).
  fork)
    (cd /tmp && python3 -X faulthandler "$OLDPWD/benchmarks/gpu/fork_check.py") 2>&1 \
      | tee "$OUT/fork.log" | grep -v "^\s*File\|^  " | tail -20
    grep RESULT "$OUT/fork.log" | sed 's/^RESULT //' >> "$OUT/results.jsonl"
    ;;
  # Issue 38: the fork check, then the device feed still delivers (short train_feed rows).
  v38fork)
    bash "$0" fork --no-install
    timeout 200 python3 benchmarks/gpu/train_feed.py --batch-samples 5 --seconds 5 \
      --alone-seconds 3 --unique 32 --copies 10 --jsonl "$OUT/results.jsonl" \
      --rows synthetic,hsl_bf16_static,hsl_fp8_follow,hsl_bf16_static_alone \
      2>"$OUT/v38.log" | grep RESULT | cut -c1-400
    ;;
  v35)
    bash "$0" verify --no-install
    bash "$0" fork --no-install
    ;;
  # Issue 46: forward capture beside a drafter. v46a: the sweep's engines with ngram (one
  # with prefix caching and fp8 storage) and with a tiny echo EAGLE-3 drafter (every row
  # against HF, each sample's drafted/accepted counts checked), and one forward engine
  # without a drafter as the control.
  v46a)
    timeout 420 python3 benchmarks/gpu/verify.py --jsonl "$OUT/results.jsonl" --configs \
"capture=forward,pc=off,graphs=on,storage=bf16,sleep=off,async=off,spec=ngram;\
capture=forward,pc=on,graphs=off,storage=fp8,sleep=off,async=off,spec=ngram;\
capture=forward,pc=off,graphs=on,storage=bf16,sleep=off,async=off,spec=eagle3;\
capture=forward,pc=off,graphs=on,storage=bf16,sleep=off,async=off" \
      2>"$OUT/v46a.log" | cut -c1-1500
    ;;
  # v46b: throughput of ngram speculation alone (none) vs with forward capture of prompt
  # and generated tokens, one engine each; the 8B-shaped model (dummy weights), CUDA
  # graphs, repetitive prompts (256 x 512 tokens, 256 generated). vLLM's drafted/accepted
  # counters of each timed run are in its row (spec_counts).
  # py-spy on both (the first run measured 0.60x: 6.4 GB of rows in 11.3 s against 6.8 s
  # without capture; where the 4.5 s go is what the profile is for).
  v46b)
    spy=$(pyspy_binary) || echo "py-spy unavailable"
    $B throughput --workloads 256x512x256 --max-model-len 1024 \
      --kinds none,forward --graph-modes graphs --spec ngram \
      --prompt-kind repetitive --timeout 240 --pyspy "$spy" --pyspy-out "$OUT/pyspy" \
      --connector '{"include_output_tokens": true, "capture_buffer_bytes": "12GiB"}' \
      --json "$OUT/t.json" 2>>"$OUT/v46b.log" | tail -6
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # Issue 45: where the time goes. One engine per kind, decode-heavy (256 x 512 tokens,
  # 256 generated) then prefill-heavy (256 x 1,024, 1 generated) on each, CUDA graphs;
  # py-spy (every thread, idle included; then GIL holders) on the decode-heavy run of
  # none and forward. noop: a KV connector that does nothing (vLLM's connector hooks);
  # forward-discard: forward capture with every stage but the file.
  v45a)
    spy=$(pyspy_binary) || echo "py-spy unavailable"
    $B throughput --workloads 256x512x256,256x1024x1 --max-model-len 2048 \
      --kinds none,forward --graph-modes graphs --timeout 300 --pyspy "$spy" \
      --pyspy-out "$OUT/pyspy" --json "$OUT/t.json" 2>>"$OUT/v45a.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    $B throughput --workloads 256x512x256,256x1024x1 --max-model-len 2048 \
      --kinds noop,forward-discard --graph-modes graphs --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v45a.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # v45p: after the token-major ingest, the throughput pair alone on a warm machine
  # (prefill-heavy first: its 0.92x matched the old ingest's ~1.1 GB/s host copy).
  v45p)
    $B throughput --workloads 256x1024x1,256x512x256 --max-model-len 2048 \
      --kinds forward,none --graph-modes graphs --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v45p.log" | grep -v WARNING | tail -6
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # v45r: issue 45's done-when rows in one call: none and forward interleaved, 2 repeats,
  # decode- and prefill-heavy; the gpu_memory_utilization 0.5 pair (KV blocks); the
  # ingest step alone on this host's CPU (1 and 4 torch threads; no vLLM).
  v45r)
    python3 benchmarks/ingest_step.py --threads 1 --steps 10 --copy-threads 1,2,4,8 \
      | tee -a "$OUT/ingest.jsonl"
    python3 benchmarks/ingest_step.py --threads 4 --steps 10 | tee -a "$OUT/ingest.jsonl"
    $B throughput --workloads 256x1024x1,256x512x256 --max-model-len 2048 \
      --kinds none,forward --repeats 2 --graph-modes graphs --timeout 200 \
      --json "$OUT/t.json" 2>>"$OUT/v45r.log" | grep -v WARNING | tail -10
    $B throughput --workloads 64x512x16 --max-model-len 2048 --gpu-mem 0.5 \
      --kinds none,forward --graph-modes graphs --timeout 150 \
      --json "$OUT/m.json" 2>>"$OUT/v45r.log" | grep -v WARNING | tail -4
    cat "$OUT/t.jsonl" "$OUT/m.jsonl" > "$OUT/results.jsonl"
    ;;
  # v45c: the figure users compare: a chat-like mix (512 requests, prompts 200-4,000
  # tokens, replies 100-1,000), prompt and reply captured, against no capture: samples/s
  # and GB/s written.
  v45c)
    $B throughput --workloads chat512 --max-model-len 6144 --kinds none,forward \
      --graph-modes graphs --timeout 300 \
      --connector '{"include_output_tokens": true, "capture_buffer_bytes": "32GiB"}' \
      --json "$OUT/t.json" 2>>"$OUT/v45c.log" | grep -v WARNING | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  # v45b: v45a cut to what a short call holds: decode-heavy only, none and forward (py-spy).
  v45b)
    spy=$(pyspy_binary) || echo "py-spy unavailable"
    $B throughput --workloads 256x512x256 --max-model-len 1024 --kinds none,forward \
      --graph-modes graphs --timeout 240 --pyspy "$spy" --pyspy-out "$OUT/pyspy" \
      --json "$OUT/t.json" 2>>"$OUT/v45b.log" | tail -4
    cp "$OUT/t.jsonl" "$OUT/results.jsonl"
    ;;
  *) echo "unknown plan $plan"; exit 2 ;;
esac
