#!/usr/bin/env bash
# One run on the GPU machine: install the offline wheels, run the GPU tests, then the benchmarks.
# Usage (device tool, with .whl carried): bash scripts/gpu_check.sh [tests] [decode] [floor] [kernels] [sweep] [gemv] [skinny] [replay-check] [host]
#   [structured] [loading] [loading-rate32] [loading-nostreams] [serve] [serve-moe] [concurrency] [slora] [serve-sync]
#   [serve-prefix] [serve-late] [tp] [moe] [hf] [gateway] [large] [scale] [scale-many] [warm-reads] [lora-gemm]
#   [structured-serve]
# Logs and JSON go to $OUT; with more than 8 files there (what the device tool brings back), all of them are packed
# into $OUT/gpu_check.tgz at the end. SWEEP_ARGS / SERVE_ARGS add flags to bench.sweep / bench.serve.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
MODEL=${MODEL:-bench/configs/llama-3.1-8b}

serve_preset() {   # serve_preset NAME [SUFFIX SERVER_FLAG...]: the dummy server of $MODEL (8B unless set) with the
                   # preset's flags and adapters (plus any extra flags), then the preset; results in NAME[SUFFIX].json
  local name=$1 suffix=${2:-} adapters=/tmp/adapters-$1
  local extra=("${@:3}")
  local vocab
  vocab=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
  [ -d /tmp/tok-$vocab ] || python3 -m bench.make_tokenizer --vocab-size "$vocab" --out /tmp/tok-$vocab
  read -r -a make_args <<< "$(python3 -c "from bench.presets import PRESETS; print(PRESETS['$name'].make_adapters_args())")"
  read -r -a server_args <<< "$(python3 -c "from bench.presets import PRESETS; print(PRESETS['$name'].server_args)")"
  python3 -m bench.make_adapters --config $MODEL --out $adapters "${make_args[@]}" > /dev/null 2>&1
  echo "preset $name$suffix: server ${server_args[*]} ${extra[*]}, adapters ${make_args[*]}" >> "$OUT/serve.log"
  python3 -m gateway serve --model $MODEL --tokenizer /tmp/tok-$vocab --load-format dummy --max-model-len 4096 \
    --port 8100 --uvicorn-log-level warning --lora-modules $(for a in $adapters/*; do echo "${a##*/}=$a"; done) \
    "${server_args[@]}" "${extra[@]}" >> "$OUT/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do curl -sf localhost:8100/health >/dev/null && break; sleep 1; done
  timeout ${SERVE_TIMEOUT:-200} python3 -m bench.serve --base-url http://127.0.0.1:8100 --preset "$name" --no-plots --no-progress ${SERVE_ARGS:-} \
    --out "$OUT/$name$suffix.json" >> "$OUT/serve.log" 2>&1
  local rc=$?
  echo "preset $name$suffix: rc=$rc" >> "$OUT/serve.log"
  kill $pid; wait $pid
  return $rc
}

start_server() {   # start_server LOG ADAPTER_DIR SERVER_FLAG...: $MODEL's dummy server with every adapter of the
                   # folder as --lora-modules, on port 8100; waits for /health and the adapters, sets $server_pid
  local log=$1 adapters=$2 vocab
  vocab=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
  [ -d /tmp/tok-$vocab ] || python3 -m bench.make_tokenizer --vocab-size "$vocab" --out /tmp/tok-$vocab
  python3 -m gateway serve --model $MODEL --tokenizer /tmp/tok-$vocab --load-format dummy --max-model-len 4096 \
    --port 8100 --uvicorn-log-level warning "${@:3}" \
    --lora-modules $(for a in "$adapters"/*; do echo "${a##*/}=$a"; done) >> "$log" 2>&1 &
  server_pid=$!
  local t0=$SECONDS
  for _ in $(seq 300); do curl -sf localhost:8100/health >/dev/null && break; sleep 1; done
  # the --lora-modules adapters are read into the host cache beside the first steps: wait for them (up to 240 s)
  for _ in $(seq 240); do
    curl -sf localhost:8100/v1/adapters | python3 -c "import json, sys; cards = json.load(sys.stdin)['data']; \
      sys.exit(any(c['loading'] or c['residency'] == 'disk' for c in cards))" && break
    sleep 1
  done
  echo "server up and its adapters in host memory after $((SECONDS - t0)) s" >> "$log"
  curl -sf localhost:8100/health >/dev/null
}

scale_run() {   # scale_run NAME BENCH_SERVE_FLAG...: one bench.serve run against port 8100, into $OUT/scale-NAME.json
  echo "run $1: ${*:2}" >> "$OUT/scale.log"
  timeout 300 python3 -m bench.serve --base-url http://127.0.0.1:8100 --no-plots --no-progress "${@:2}" \
    --out "$OUT/scale-$1.json" >> "$OUT/scale.log" 2>&1
}

SCALE_SHORT=(--random-input-len 130 --random-output-len 256 --random-range-ratio 0.1)   # issue 20's short requests

start_1000_adapter_server() {   # start_1000_adapter_server SLOTS: the server of make_1000_adapters' folder, rank-8 slots,
                                # every adapter in host memory, up to 256 sequences
  start_server "$OUT/scale.log" /tmp/adapters-scale1000 --max-loras "$1" --max-cpu-loras 1000 --max-lora-rank 8 \
    --max-num-seqs 256
}

make_1000_adapters() {   # /tmp/adapters-scale1000: rank-8 q, k, v, o adapters lora-0..999, 8 written and 992 links to
                         # them (distinct names, so each is its own host-cache entry and GPU slot copy)
  python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters-scale1000 --num 8 --rank 8 \
    --targets q_proj,k_proj,v_proj,o_proj > /dev/null 2>&1
  for i in $(seq 8 999); do ln -sfn /tmp/adapters-scale1000/lora-$((i % 8)) /tmp/adapters-scale1000/lora-$i; done
}

stages=${*:-tests decode}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)   # TESTS: a narrower selection of test paths (default: all GPU and kernel tests)
             timeout 590 python3 -m pytest ${TESTS:-tests/gpu tests/worker/kernels} -q -rA -p no:cacheprovider > "$OUT/tests.log" 2>&1 ;;
    decode)  # DECODE_MODES: a subset of bench.decode_step's modes (default: all)
             timeout 300 python3 -m bench.decode_step --profile ${DECODE_MODES:+--modes $DECODE_MODES} \
               --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1 ;;
    floor)   # the memory floor and graph-mode decode steps only: beside the serving presets in one run
             timeout 120 python3 -m bench.decode_step --modes graphs --out "$OUT/decode_floor.json" > "$OUT/floor.log" 2>&1 ;;
    large)   # a serving batch's steps, 8B shape: 256 decode rows (base, one adapter, 64 adapters; LoRA beside the
             # base GEMMs and in line) and a mixed step of 192 rows + 1,024 prompt tokens, each profiled
             failed=0
             # LARGE_MODES: decode_step's modes (default: also the side stream's A/B)
             timeout 400 python3 -m bench.decode_step --modes ${LARGE_MODES:-graphs-large graphs-large-inline} \
               --profile --out "$OUT/decode_large.json" > "$OUT/large.log" 2>&1 || failed=1
             timeout 200 python3 -m bench.mixed_step --profile --out "$OUT/mixed_step.json" >> "$OUT/large.log" 2>&1 || failed=1
             (exit $failed) ;;
    kernels) timeout 120 python3 -m bench.kernels_lora --out "$OUT/kernels_lora.json" > "$OUT/kernels.log" 2>&1 ;;
    structured)   # a decode step with a quarter of the batch constrained (JSON schema) against none, 8B shape
             timeout 400 python3 -m bench.structured_step --out "$OUT/structured.json" > "$OUT/structured.log" 2>&1 ;;
    structured-serve)   # every request constrained (bench.serve --structured-outputs: a regex, a JSON schema) against
             # the same load unconstrained, twice, at 32 and 256 streams (8B shape, one adapter loaded, 256 sequences)
             python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters-structured --num 1 --rank 8 > /dev/null 2>&1
             start_server "$OUT/structured_serve.log" /tmp/adapters-structured --max-num-seqs 256 \
               --max-num-batched-tokens 2048
             vocab=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
             for c in 32 256; do
               for kind in plain regex json plain2; do
                 case $kind in
                   regex) so=(--structured-outputs '{"regex": "[a-z <>0-9]+"}') ;;
                   json)  so=(--structured-outputs '{"json": {"type": "object", "properties": {"name": {"type": "string"},
                            "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                            "required": ["name", "age", "tags"]}}') ;;
                   *)     so=() ;;
                 esac
                 timeout 120 python3 -m bench.serve --base-url http://127.0.0.1:8100 --num-prompts $((c * 3)) \
                   --max-concurrency $c --random-input-len 100 --random-output-len 256 --vocab-size "$vocab" \
                   --warmup-requests 4 --no-plots --no-progress "${so[@]}" --out "$OUT/structured-$kind-$c.json" \
                   >> "$OUT/structured_serve.log" 2>&1
               done
             done
             kill $server_pid; wait $server_pid ;;
    sweep)   timeout 400 python3 -m bench.kernels_lora --sweep --out "$OUT/kernels_sweep.json" > "$OUT/sweep.log" 2>&1 ;;
    replay-check)   # the batch-32, 32-adapter graph replayed back to back, one variant per process
             # BURST: replays between syncs (default 1); REPLAY_VARIANTS: which variants, in order
             failed=0
             for variant in ${REPLAY_VARIANTS:-side-stream in-line sync-scheduling}; do
               timeout 150 python3 -m bench.graph_replay_check --variant $variant --burst ${BURST:-1} \
                 --replays ${REPLAYS:-300} --out "$OUT/replay_$variant.json" >> "$OUT/replay_check.log" 2>&1
               rc=$?; [ $rc -eq 0 ] || failed=1
               echo "replay-check $variant: rc=$rc" | tee -a "$OUT/replay_check.log"
             done
             (exit $failed) ;;
    host)    # two engines: mixed steps from graphs, then eagerly (mixed_graph_max_tokens=0)
             timeout 300 python3 -m bench.host_profile --out "$OUT/host_profile.json" > "$OUT/host_profile.log" 2>&1 ;;
    skinny)  # the skinny projection kernel against cuBLAS; SKINNY_ROWS: rows of x (default 32), swept
             timeout 420 python3 -m bench.kernels_skinny --sweep --rows ${SKINNY_ROWS:-32} \
               --out "$OUT/kernels_skinny.json" > "$OUT/skinny.log" 2>&1 ;;
    gemv)    timeout 300 python3 -m bench.kernels_gemv --sweep --out "$OUT/kernels_gemv.json" > "$OUT/gemv.log" 2>&1 ;;
    serve)   failed=0
             for preset in sglang-single-adapter sglang-multi-adapter overlap-loading; do serve_preset $preset || failed=1; done
             (exit $failed) ;;
    moe)     # bench.moe_decode (Qwen3-30B-A3B's shape, dummy weights): MOE_LAYERS of its 48 layers (default 24: fits an
             # 80 GB card), MOE_MODES (default graphs), per-kernel profile of every run; MOE_ARGS: more flags
             timeout 500 python3 -m bench.moe_decode --num-layers ${MOE_LAYERS:-24} --modes ${MOE_MODES:-graphs} --profile ${MOE_ARGS:-} \
               --out "$OUT/moe_decode.json" > "$OUT/moe.log" 2>&1 ;;
    serve-moe)   # the MoE preset on Qwen3-30B-A3B's shape with 24 of its 48 layers (weights, 8 slots fit an 80 GB card)
             mkdir -p /tmp/qwen3-moe-24 && python3 -c "import json; c = json.load(open('bench/configs/qwen3-30b-a3b/config.json')); c['num_hidden_layers'] = 24; json.dump(c, open('/tmp/qwen3-moe-24/config.json', 'w'))"
             MODEL=/tmp/qwen3-moe-24 serve_preset moe-expert-adapters ;;
    concurrency)   # bench.sweep: 1-512 streams: base, one adapter, 64 distinct adapters (8B, 64 slots); SERVER_ARGS: more
                   # server flags; the worker logs its steps' paths every 10 s
             [ -d /tmp/tok-128256 ] || python3 -m bench.make_tokenizer --vocab-size 128256 --out /tmp/tok-128256
             python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters-sweep --num 64 --rank 16 > /dev/null 2>&1
             python3 -m gateway serve --model $MODEL --tokenizer /tmp/tok-128256 --load-format dummy --max-model-len 4096 \
               --port 8100 --uvicorn-log-level warning --max-num-seqs 512 --max-loras 64 ${SERVER_ARGS:-} \
               --lora-modules $(for a in /tmp/adapters-sweep/*; do echo "${a##*/}=$a"; done) >> "$OUT/sweep.log" 2>&1 &
             pid=$!
             for _ in $(seq 180); do curl -sf localhost:8100/health >/dev/null && break; sleep 1; done
             timeout 1200 python3 -m bench.sweep --base-url http://127.0.0.1:8100 --num-loras 64 --warmup 16 \
               --out "$OUT/sweep.json" ${SWEEP_ARGS:-} >> "$OUT/sweep.log" 2>&1
             rc=$?; kill $pid; wait $pid; (exit $rc) ;;
    tp)      # tensor parallelism (2 GPUs): its GPU tests, the all-reduce bench, then 8B TP=1 and TP=2 servers side by
             # side: 1 and 32 streams, base and 32 distinct adapters (TPOT p50 is the decode step)
             # TP_TESTS=0 / TP_BENCH=0 skip the tests / the all-reduce bench; TP_SIZES: the servers (default "2 1");
             # TP_CONCURRENCY: the sweep's stream counts (default "1 32"); TP_TEST_K: a pytest -k selection of the tests
             # (run with -s, so a hung test's stack dumps reach the log); TP_SERVER_ARGS: more server flags (e.g.
             # --kernel-config {"lora_side_stream":false}, no spaces), TP_TAG: a suffix for the result files;
             # TP_RANK: the adapters' rank (default 16; the servers' --max-lora-rank follows it)
             failed=0
             if [ "${TP_TESTS:-1}" = 1 ]; then
               timeout 400 python3 -m pytest -x -q -s -rA -p no:cacheprovider ${TP_TEST_K:+-k "$TP_TEST_K"} \
                 tests/gpu/test_all_reduce_gpu.py tests/gpu/test_tensor_parallel_gpu.py > "$OUT/tp_tests.log" 2>&1 || failed=1
             fi
             if [ "${TP_BENCH:-1}" = 1 ]; then
               timeout 200 python3 -m bench.all_reduce --check --out "$OUT/all_reduce.json" > "$OUT/all_reduce.log" 2>&1 || failed=1
             fi
             [ -d /tmp/tok-128256 ] || python3 -m bench.make_tokenizer --vocab-size 128256 --out /tmp/tok-128256
             rank=${TP_RANK:-16}
             [ -d /tmp/adapters-tp-r$rank ] || python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters-tp-r$rank \
               --num 32 --rank $rank > /dev/null 2>&1
             for tp in ${TP_SIZES:-2 1}; do
               python3 -m gateway serve --model $MODEL --tokenizer /tmp/tok-128256 --load-format dummy --max-model-len 4096 \
                 --port 8100 --uvicorn-log-level warning --max-loras 32 --max-lora-rank $rank --tensor-parallel-size $tp \
                 ${TP_SERVER_ARGS:-} --lora-modules $(for a in /tmp/adapters-tp-r$rank/*; do echo "${a##*/}=$a"; done) \
                 >> "$OUT/tp_serve.log" 2>&1 &
               pid=$!
               for _ in $(seq 240); do curl -sf localhost:8100/health >/dev/null && break; sleep 1; done
               timeout 300 python3 -m bench.sweep --base-url http://127.0.0.1:8100 --concurrency ${TP_CONCURRENCY:-1 32} --adapters base many \
                 --num-loras 32 --warmup 8 --output-len 128 --out "$OUT/tp$tp${TP_TAG:-}.json" >> "$OUT/tp_serve.log" 2>&1 || failed=1
               kill $pid; wait $pid
             done
             (exit $failed) ;;
    scale)   # issue 20's shapes (prompts ~130 tokens, 256 out, ignore_eos), one server each, runs side by side:
             # A: 32 rank-16 adapters on all projections, --max-loras 32: the cold burst (32 streams, 32 never-used
             #    adapters at once), then one 2,500-token prompt at a time (base / one adapter) and 32 at once (base /
             #    32 adapters), two rounds; B: rank-8 q,k,v,o adapters, --max-loras 32, --max-lora-rank 8, host cache
             #    for all: 128 in flight of 256 requests, zipf 1.0, base / 8 adapters / 1,000 adapters three times
             failed=0
             python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters-scale32 --num 32 --rank 16 > /dev/null 2>&1
             start_server "$OUT/scale.log" /tmp/adapters-scale32 --max-loras 32 --max-cpu-loras 32 || failed=1
             scale_run cold-burst "${SCALE_SHORT[@]}" --num-prompts 32 --lora-prefix lora --num-loras 32 \
               --lora-choice distinct --seed 11 || failed=1
             long1=(--num-prompts 12 --max-concurrency 1 --random-input-len 2500 --random-output-len 16)
             long32=(--num-prompts 32 --random-input-len 2500 --random-output-len 128)
             for round in 1 2; do
               scale_run long1-base-$round "${long1[@]}" --seed ${round}21 || failed=1
               scale_run long1-lora-$round "${long1[@]}" --lora-names lora-0 --seed ${round}22 || failed=1
               scale_run long32-base-$round "${long32[@]}" --seed ${round}23 || failed=1
               scale_run long32-lora-$round "${long32[@]}" --lora-prefix lora --num-loras 32 --lora-choice distinct \
                 --seed ${round}24 || failed=1
             done
             kill $server_pid; wait $server_pid
             make_1000_adapters
             start_1000_adapter_server 32 || failed=1
             many=("${SCALE_SHORT[@]}" --num-prompts 256 --max-concurrency 128 --lora-choice zipf --zipf-alpha 1.0)
             scale_run many-base "${SCALE_SHORT[@]}" --num-prompts 256 --max-concurrency 128 --seed 31 || failed=1
             scale_run many-8 "${many[@]}" --lora-prefix lora --num-loras 8 --seed 32 || failed=1
             for run in 1 2 3; do
               scale_run many-1000-$run "${many[@]}" --lora-prefix lora --num-loras 1000 --seed 3$((run + 2)) || failed=1
             done
             kill $server_pid; wait $server_pid
             (exit $failed) ;;
    scale-many)   # the 1,000-adapter shape two more ways: at a fixed Poisson rate (24 req/s, ~70% of what the 8-adapter
                  # run sustains with 128 in flight) over 8 and over 1,000 adapters (32 slots); then 128 in flight with
                  # --max-loras 128 (8, then 1,000 adapters twice)
             failed=0
             make_1000_adapters
             many=("${SCALE_SHORT[@]}" --lora-choice zipf --zipf-alpha 1.0 --lora-prefix lora)
             start_1000_adapter_server 32 || failed=1
             rate=(--num-prompts 512 --request-rate 24 --arrival poisson)
             scale_run rate-8 "${many[@]}" "${rate[@]}" --num-loras 8 --seed 41 || failed=1
             scale_run rate-1000-1 "${many[@]}" "${rate[@]}" --num-loras 1000 --seed 42 || failed=1
             scale_run rate-1000-2 "${many[@]}" "${rate[@]}" --num-loras 1000 --seed 43 || failed=1
             kill $server_pid; wait $server_pid
             start_1000_adapter_server 128 || failed=1
             closed=(--num-prompts 256 --max-concurrency 128)
             scale_run slots128-8 "${many[@]}" "${closed[@]}" --num-loras 8 --seed 44 || failed=1
             scale_run slots128-1000-1 "${many[@]}" "${closed[@]}" --num-loras 1000 --seed 45 || failed=1
             scale_run slots128-1000-2 "${many[@]}" "${closed[@]}" --num-loras 1000 --seed 46 || failed=1
             kill $server_pid; wait $server_pid
             (exit $failed) ;;
    slora)   failed=0
             for preset in slora-8 slora-100 slora-1000; do SERVE_TIMEOUT=420 serve_preset $preset || failed=1; done
             (exit $failed) ;;
    serve-sync)   # the same presets with async scheduling off: its TTFT cost and ITL gain side by side
             failed=0
             for preset in sglang-single-adapter sglang-multi-adapter; do
               serve_preset $preset -sync --no-async-scheduling || failed=1
             done
             (exit $failed) ;;
    serve-prefix)   # prefix caching: the chat preset's TTFT and the no-shared-prefix throughput, caching on and off
             # PREFIX_PRESETS: which of the two (default both)
             failed=0
             for preset in ${PREFIX_PRESETS:-chat-shared-prefix chat-no-shared-prefix}; do
               SERVE_TIMEOUT=420 serve_preset $preset || failed=1
               SERVE_TIMEOUT=420 serve_preset $preset -nocache --no-enable-prefix-caching || failed=1
             done
             (exit $failed) ;;
    serve-late)   # late launch: chat-shared-prefix (caching on) with --late-launch, then --no-late-launch
             failed=0
             SERVE_TIMEOUT=420 serve_preset chat-shared-prefix -late || failed=1
             SERVE_TIMEOUT=420 serve_preset chat-shared-prefix -nolate --no-late-launch || failed=1
             (exit $failed) ;;
    hf)      python3 -m bench.make_adapters --config $MODEL --out /tmp/adapters --num 6 --rank 16 > /dev/null 2>&1
             timeout 200 python3 -m bench.hf_baseline --model $MODEL --load-format dummy --lora-dir /tmp/adapters \
               --preset sglang-multi-adapter --num-prompts 64 --random-input-len 256 --random-output-len 32 \
               --batch-size 32 --no-plots \
               --out "$OUT/hf_baseline.json" >> "$OUT/serve.log" 2>&1 ;;
    gateway)   # the gateway with its stand-in worker (no GPU): 256 and 512 streams free-running, 512 at 8 ms steps
             failed=0
             for run in "256 0 256" "512 0 256" "512 8 128"; do
               read -r streams step_ms max_tokens <<< "$run"
               timeout 150 python3 -m bench.gateway_throughput --streams $streams --step-ms $step_ms \
                 --max-tokens $max_tokens --duration 10 --out "$OUT/gateway_throughput-$streams-${step_ms}ms.json" \
                 >> "$OUT/gateway.log" 2>&1 || failed=1
             done
             (exit $failed) ;;
    loading) timeout 360 python3 -m bench.lora_loading --out "$OUT/lora_loading.json" > "$OUT/loading.log" 2>&1 ;;
    loading-rate32)   # the same adapters and traffic at twice the arrival rate
             timeout 360 python3 -m bench.lora_loading --rate 32 --out "$OUT/lora_loading_rate32.json" \
               > "$OUT/loading_rate32.log" 2>&1 ;;
    loading-nostreams)   # the zipf runs without the resident streams (no long requests running through the traffic)
             timeout 120 python3 -m bench.lora_loading --ranks 16 --patterns zipf1.5 --resident-streams 0 \
               --out "$OUT/lora_loading_nostreams.json" > "$OUT/loading_nostreams.log" 2>&1
             timeout 120 python3 -m bench.lora_loading --ranks 16 --patterns zipf1.5 --resident-streams 0 \
               --no-async-scheduling --out "$OUT/lora_loading_nostreams_sync.json" >> "$OUT/loading_nostreams.log" 2>&1 ;;
    lora-gemm)   # the fused-GEMM LoRA path: its kernel, bench and engine tests, then bench.kernels_lora_gemm
             # (LORA_GEMM_ARGS: more flags, e.g. --sweep)
             python3 -m pytest -q tests/worker/kernels/test_lora_gemm.py tests/bench/test_kernels_lora_gemm_bench.py \
               tests/gpu/test_engine_gpu.py -k "lora_gemm or fused or candidate or segments" > "$OUT/lora_gemm_tests.log" 2>&1
             timeout 400 python3 -m bench.kernels_lora_gemm --out "$OUT/lora_gemm.json" --rows 16 64 256 1024 4096 \
               --adapters 1 8 64 ${LORA_GEMM_ARGS:-} > "$OUT/lora_gemm.log" 2>&1 ;;
    warm-reads)   # 1,000 rank-8 q,k,v,o --lora-modules (50 files hard-linked 20 times): TPOT while they are read after
             # startup against after (bench.warm_reads), 8 and 256 streams; WARM_ARGS: more bench.warm_reads flags
             python3 -m bench.make_tokenizer --vocab-size 128256 --out /tmp/tok > /dev/null 2>&1
             python3 -m bench.make_adapters --config $MODEL --out /tmp/warm0 --num 50 --rank 8 \
               --targets q_proj,k_proj,v_proj,o_proj --device cuda > /dev/null 2>&1
             for i in $(seq 0 999); do mkdir -p /tmp/warm/lora-$i; ln -f /tmp/warm0/lora-$((i % 50))/* /tmp/warm/lora-$i/; done
             timeout 420 python3 -m bench.warm_reads --model $MODEL --adapters /tmp/warm --num-adapters 1000 \
               --streams 8 256 --seconds 30 ${WARM_ARGS:-} --out "$OUT/warm_reads.json" -- --tokenizer /tmp/tok \
               --max-loras 128 --max-lora-rank 64 --max-num-seqs 256 > "$OUT/warm_reads.log" 2>&1 ;;
  esac
  echo "$stage: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
done
tail -5 "$OUT"/tests.log 2>/dev/null
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then      # the device tool brings back at most 8 files
  tar czf /tmp/gpu_check.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_check.tgz "$OUT/"
fi
