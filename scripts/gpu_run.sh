#!/usr/bin/env bash
# Runs ON the GPU machine (device tool), from the repo root, after scripts/make_gpu_bundle.sh here:
#   build sfi-gguf with CUDA for sm_90 from the carried tree, run the GPU tests, run the benchmarks.
# Usage: bash scripts/gpu_run.sh [stage ...]   stages: build tests overhead native bench (default: all),
#   overhead-dropin (the overhead stage plus llama-cpp-python's token loop on llama_cpp.Llama and sfi_gguf.Llama),
#   diag, profile (export ops and candidate slow steps), cycle (refresh cycles: what a refresh costs, part by part;
#   SFI_CYCLE_CTX, SFI_CYCLE_M, SFI_CYCLE_CANDIDATES, SFI_CYCLE_ARGS, SFI_BENCH_TAG),
#   op-profile (every node of a dense / slow / fast step timed, benchmarks/op_profile.py; SFI_PROFILE_KINDS (slow_tail:
#   redecode_tail's slow step, SFI_PROFILE_TAIL tokens again),
#   SFI_PROFILE_GROUPS, SFI_PROFILE_TOP, SFI_PROFILE_BATCH: sequences per step, e.g. 16 with SFI_CYCLE_CTX=32768),
#   bench (SFI_BENCH_DEPTHS, SFI_BENCH_SHAPES: qwen3-4b qwen3-0.6b ..., SFI_BENCH_WEIGHTS: f16 q4_k_m ..., SFI_BENCH_ARGS: more options, e.g. "--confidence-trace benchmarks/data/<trace>.json", SFI_BENCH_TAG),
#   bench-delay (selection_delay $SFI_DELAYS, default 0 16 32, at 128K),
#   op-tests (the SFI ggml ops against their CPU definition, then timed: SFI_PERF_NKV cells, SFI_PERF_STREAMS streams, e.g. "1 4"),
#   trace (a CUPTI kernel trace of refresh cycles cut into steps: SFI_TRACE_CTX, SFI_TRACE_TAIL; needs .gpu/cupti),
#   selector-tests (the device Selector against numpy), greedy-tests (greedy picks in the graph against the host's), batched-tests, batched-bench (sequences x depth from $SFI_BATCHES, e.g. "16:32768 4:131072"),
#   sampling-tests (the SFI sampling op's kernel, then sampling in the graph against the host chain), sampling-bench (SFI and dense with each step's pick
#   greedy, default sampling in the graph, or on the host: $SFI_SAMPLINGS, default "greedy default host"; single at
#   $SFI_BENCH_DEPTHS, default 32768 131072, and batched $SFI_SAMPLING_BATCHES, default 4:32768),
#   serve-load (benchmarks/serve_load.py: sfi-gguf serve --parallel 8, SFI against --dense, the openai client from
#   .gpu/wheels-openai; SFI_LOAD_N conversations, default 8, of SFI_LOAD_DOC tokens, default 32768),
#   host-profile (py-spy --native over sfi-gguf bench: the host's time per phase; SFI_PROFILE_DEPTHS, SFI_PROFILE_RATE samples/s),
#   kv-on-host-bench (sfi-gguf bench --kv-on-host: dense with host KV, SFI with host KV, dense with the KV in VRAM;
#   $SFI_KVH_RUNS, default "qwen3-4b:f16:32768,131072", e.g. "qwen3-8b:q4_k_m:131072,262144"; SFI_BENCH_N;
#   SFI_BENCH_ARGS=--prefill-in-vram loads the host cache from a prefill in GPU memory: a host-KV prefill takes minutes at 128K),
#   keep-graphs-bench (graph keeping on and off: single at $SFI_BENCH_DEPTHS, batched $SFI_KEEP_BATCHES, default 4:32768,
#   synchronised and --stagger 1),
#   and multigpu (2+ GPUs: = multigpu-tests multigpu-bench, which can also run as separate calls)
# Results go to $OUT (the device tool brings them back, as results.tgz when there are more than 8) or .gpu-out/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.gpu-out}; mkdir -p "$OUT"
export SFI_GGUF_CACHE=$PWD/.gpu-cache      # kept between calls while the machine stays warm
export PYTHONUNBUFFERED=1
# the commit the results belong to (make_gpu_bundle.sh / the caller writes it: the copied tree has no usable git)
[[ -f .gpu/COMMIT ]] && export SFI_GIT_COMMIT=$(cat .gpu/COMMIT)
stages=${*:-build tests overhead native bench}
[[ " $stages " == *" multigpu "* ]] && stages="$stages multigpu-tests multigpu-bench"
log() { echo "== $(date +%T) $*"; }

if [[ " $stages " == *" build "* ]]; then
    log "install carried wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile .gpu/wheels/*.whl || exit 1
    log "build (CUDA sm_90)"
    export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    SFI_LLAMA_CPP_SOURCE=$PWD/.gpu/llama.cpp CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 ${CMAKE_ARGS:-}" \
        SFI_PIP_QUIET=-v bash scripts/setup.sh > "$OUT/build.log" 2>&1 || { grep -n -i -B2 -A12 "error" "$OUT/build.log" | head -80; exit 1; }
    tail -3 "$OUT/build.log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
if [[ " $stages " == *" diag "* ]]; then
    log "toolchain and exported libstdc++ symbols"
    LIB=$(python3 -c "from sfi_gguf.core.library import find_lib_dir; print(find_lib_dir())" 2>/dev/null)
    { grep -E "CXX compiler identification|CUDA compiler identification|CUDA host compiler|CMAKE_CUDA_HOST" "$OUT/build.log" | head
      which g++ c++ nvcc; g++ --version | head -1; echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
      for f in "$LIB"/*.so*; do echo "-- $f: $(nm -D --defined-only "$f" 2>/dev/null | grep -c 'St.*basic_ostream\|_M_insert') ostream symbols"
          readelf -d "$f" | grep -E "NEEDED|RUNPATH|RPATH" | tr -s ' ' | cut -d' ' -f3- ; done
      ldd "$LIB/libggml-cuda.so" | grep -E "stdc|gcc"
      nm -D --defined-only "$LIB/libggml-cuda.so" | c++filt | grep -E "_M_insert|ostream" | head -5
    } > "$OUT/diag.txt" 2>&1
    cat "$OUT/diag.txt"
    log "tiny native test, plain and with LD_DEBUG"
    SFI_TEST_NGL=99 timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_native.py -k "in_order and tiny-fa" 2>&1 | tail -3
    SFI_TEST_NGL=99 LD_DEBUG=bindings LD_DEBUG_OUTPUT=$OUT/ld timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_native.py -k "in_order and tiny-fa" 2>&1 | tail -2
    cat "$OUT"/ld.* 2>/dev/null | grep -E "_M_insert|do_unshift" | head -8; rm -f "$OUT"/ld.*
fi
model() {  # random-weight model of a named shape carrying the default model's tokenizer (.gpu/vocab.gguf)
    python3 -m sfi_gguf.tools.random_model "$1" --weight-type "$2" --vocab-source "$PWD/.gpu/vocab.gguf" | tail -1
}
if [[ " $stages " == *" tests "* ]]; then
    log "native tests on the GPU"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_native.py \
        2>&1 | tee "$OUT/gpu-tests.log" | tail -15
fi
if [[ " $stages " == *" op-tests "* ]]; then
    log "SFI ggml ops on the GPU against their composite definition on the CPU"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider tests/test_sfi_ops.py -k every_backend -s \
        2>&1 | tee "$OUT/gpu-op-tests.log" | grep -v "^ok " | tail -8
    log "the SFI ops timed at a slow step's shape"
    for ns in ${SFI_PERF_STREAMS:-1}; do
        "$(python3 -c "from sfi_gguf.core.library import find_lib_dir; print(find_lib_dir())")/sfi-test-ops" perf -s $ns ${SFI_PERF_NKV:-32768 131328} \
            2>&1 | tee -a "$OUT/gpu-op-perf.txt"
    done
fi
if [[ " $stages " == *" trace "* ]]; then
    log "kernel trace of refresh cycles (CUPTI: benchmarks/cupti_trace.c, cupti_steps.py; Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    for ctx in ${SFI_TRACE_CTX:-131072}; do
        CUDA_INJECTION64_PATH=$PWD/.gpu/cupti/libsfi_cupti_trace.so SFI_CUPTI_TRACE=$OUT/trace-$ctx.csv \
            python3 benchmarks/native_step_bench.py --model "$M" --ngl 99 --ctx $ctx --budget 2308 --steps 4 --cycle 15 \
            --cycle-candidates 8192 --cycles 3 --json "$OUT/native_step-h200-cycle-$ctx-traced.json" 2>&1 | grep "cycle @\|dense @\|fast  @"
        python3 benchmarks/cupti_steps.py "$OUT/trace-$ctx.csv" --tail ${SFI_TRACE_TAIL:-60} --top 30 \
            --json "$OUT/trace-steps-h200-qwen3-4b-$ctx.json" > "$OUT/trace-steps-$ctx.txt"
        rm -f "$OUT/trace-$ctx.csv"
        tail -n +2 "$OUT/trace-steps-$ctx.txt" | head -150
    done
fi
if [[ " $stages " == *" selector-tests "* ]]; then
    log "device Selector tests on the GPU (selections against the numpy reference)"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider tests/test_device_selector.py \
        2>&1 | tee "$OUT/gpu-selector-tests.log" | tail -5
fi
if [[ " $stages " == *" greedy-tests "* ]]; then
    log "greedy picks in the graph on the GPU against the host's argmax and softmax"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_device_greedy.py \
        2>&1 | tee "$OUT/gpu-greedy-tests.log" | tail -5
fi
if [[ " $stages " == *" sampling-tests "* ]]; then
    log "the SFI sampling op's kernel against its definition"
    "$(python3 -c "from sfi_gguf.core.library import find_lib_dir; print(find_lib_dir())")/sfi-test-ops" -v 2>&1 \
        | grep -E "sfi_sample|FAIL|runs" | tee "$OUT/gpu-sample-op-tests.log"
    log "sampling in the graph on the GPU against the host chain (tokens per seed, top-1 probabilities, batches)"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_device_sampling.py \
        2>&1 | tee "$OUT/gpu-sampling-tests.log" | tail -5
fi
if [[ " $stages " == *" sampling-bench "* ]]; then
    # the target: default sampling within 3% of greedy (SFI tok/s), single at 32K and 128K, 4 x 32K batched
    log "sfi-gguf bench, each step's pick: ${SFI_SAMPLINGS:-greedy default host}, on the same contexts (Qwen3-4B shape, F16)"
    python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
        --depths ${SFI_BENCH_DEPTHS:-32768 131072} -n ${SFI_BENCH_N:-256} --sampling ${SFI_SAMPLINGS:-greedy default host} \
        ${SFI_BENCH_ARGS:-} --json "$OUT/bench-h200-qwen3-4b-f16-sampling${SFI_BENCH_TAG:-}.json" 2>&1 | grep -v "^load:" | tail -12
    for s in ${SFI_SAMPLINGS:-greedy default host}; do
        for bd in ${SFI_SAMPLING_BATCHES:-4:32768}; do
            b=${bd%%:*}; d=${bd##*:}
            python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
                --batch "$b" --depths "$d" -n ${SFI_BENCH_N:-256} --sampling $s ${SFI_BENCH_ARGS:-} \
                --json "$OUT/bench-h200-qwen3-4b-f16-batch$b-$d-$s${SFI_BENCH_TAG:-}.json" 2>&1 | grep -v "^load:" | tail -3
        done
    done
fi
if [[ " $stages " == *" serve-load "* ]]; then
    log "the server under load: 8 slots, SFI against --dense (Qwen3-4B shape, F16; benchmarks/serve_load.py)"
    python3 -m pip install -q --no-index --find-links .gpu/wheels-openai openai || exit 1
    M=$(model qwen3-4b f16)
    python3 benchmarks/serve_load.py -m "$M" -ngl 99 --parallel 8 --conversations ${SFI_LOAD_N:-8} \
        --doc-tokens ${SFI_LOAD_DOC:-32768} --max-tokens 256 \
        --json "$OUT/serve_load-h200-qwen3-4b-f16-p8-c${SFI_LOAD_N:-8}-${SFI_LOAD_DOC:-32768}${SFI_BENCH_TAG:-}.json" \
        ${SFI_LOAD_ARGS:-} 2>&1 | tail -14  # (SFI_LOAD_ARGS last: its --server-args takes the rest)
fi
if [[ " $stages " == *" overhead "* ]]; then
    log "dense overhead: SFILlama vs C (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    python3 benchmarks/dense_overhead.py --model "$M" -ngl 99 --depth 2048 8192 --n-decode 128 --repeats 3 \
        --out "$OUT/dense_overhead-h200.json"
fi
if [[ " $stages " == *" overhead-dropin "* ]]; then
    log "dense overhead with llama-cpp-python's loop: llama_cpp.Llama and sfi_gguf.Llama vs C (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    python3 benchmarks/dense_overhead.py --model "$M" -ngl 99 --depth 2048 8192 --n-decode 128 --repeats 3 --dropin \
        --out "$OUT/dense_overhead_dropin-h200.json"
fi
if [[ " $stages " == *" native "* ]]; then
    log "native step micro-benchmark (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    for ctx in ${SFI_NATIVE_CTX:-32768 131072}; do
        python3 benchmarks/native_step_bench.py --model "$M" --ngl 99 --ctx "$ctx" --budget 2048 \
            --json "$OUT/native_step-h200-$ctx.json"
    done
fi
if [[ " $stages " == *" profile "* ]]; then
    log "export ops of a slow step, per stage (Qwen3-4B shape, 36 layers)"
    LIB=$(python3 -c "from sfi_gguf.core.library import find_lib_dir; print(find_lib_dir())")
    g++ -O2 -std=c++17 benchmarks/export_ops_bench.cpp -I.gpu/llama.cpp/ggml/include -L"$LIB" -lggml -lggml-base \
        -Wl,-rpath,"$LIB" -o "$OUT/export_ops_bench" || exit 1
    for n_kv in ${SFI_PROFILE_NKV:-32768 131072}; do "$OUT/export_ops_bench" "$n_kv" 8192 | tee -a "$OUT/export_ops-h200.txt"; done
    rm -f "$OUT/export_ops_bench"
    log "native step micro-benchmark with candidate exports (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    python3 benchmarks/native_step_bench.py --model "$M" --ngl 99 --ctx 131072 --budget 2048 --steps 16 \
        --n-candidates 8192 4096 --json "$OUT/native_step-h200-candidates-131072.json"
fi
if [[ " $stages " == *" cycle "* ]]; then
    log "refresh cycles: slow step with the device Selector + its selection + M fast steps (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    python3 benchmarks/native_step_bench.py --model "$M" --ngl 99 --ctx ${SFI_CYCLE_CTX:-131072} --budget 2308 --steps 8 \
        --cycle ${SFI_CYCLE_M:-15} --cycle-candidates ${SFI_CYCLE_CANDIDATES:-8192 4096} ${SFI_CYCLE_ARGS:-} \
        --json "$OUT/native_step-h200-cycle-${SFI_CYCLE_CTX:-131072}${SFI_BENCH_TAG:-}.json" 2>&1 | grep -v "^load\|^llama\|^print_info"
fi
if [[ " $stages " == *" op-profile "* ]]; then
    log "every node of a dense, slow (device Selector) and fast step, timed one by one (Qwen3-4B shape, F16)"
    M=$(model qwen3-4b f16)
    python3 benchmarks/op_profile.py --model "$M" --ngl 99 --ctx ${SFI_CYCLE_CTX:-131072} --refresh-layer-groups ${SFI_PROFILE_GROUPS:-2} \
        --kinds ${SFI_PROFILE_KINDS:-dense slow fast} --tail ${SFI_PROFILE_TAIL:-16} --top ${SFI_PROFILE_TOP:-25} --batch ${SFI_PROFILE_BATCH:-1} \
        --json "$OUT/op_profile-h200-${SFI_PROFILE_BATCH:-1}x${SFI_CYCLE_CTX:-131072}${SFI_BENCH_TAG:-}.json" 2>&1 | grep -v "^load\|^llama\|^print_info"
fi
if [[ " $stages " == *" bench-delay "* ]]; then
    log "sfi-gguf bench at 128K: Selector on the decoding thread vs delayed selection"
    for d in ${SFI_DELAYS:-0 16 32}; do
        python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
            --depths ${SFI_BENCH_DEPTHS:-131072} -n ${SFI_BENCH_N:-256} --selection-delay $d \
            --json "$OUT/bench-h200-qwen3-4b-f16-delay$d.json" 2>&1 | grep -v "^load:" | tail -3
    done
fi
if [[ " $stages " == *" bench "* ]]; then
    for shape in ${SFI_BENCH_SHAPES:-qwen3-4b}; do
        for wt in ${SFI_BENCH_WEIGHTS:-f16}; do
            log "sfi-gguf bench: dense vs SFI ($shape shape, $wt)"
            python3 -m sfi_gguf.cli bench -m $shape --weight-type $wt --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
                --depths ${SFI_BENCH_DEPTHS:-8192 32768 131072} -n ${SFI_BENCH_N:-256} ${SFI_BENCH_ARGS:-} \
                --json "$OUT/bench-h200-$shape-$wt${SFI_BENCH_TAG:-}.json" --markdown "$OUT/bench-h200-$shape-$wt${SFI_BENCH_TAG:-}.md" \
                2>&1 | grep -v "^load:" | tail -20
        done
    done
fi
if [[ " $stages " == *" kv-on-host-bench "* ]]; then
    for run in ${SFI_KVH_RUNS:-qwen3-4b:f16:32768,131072}; do
        IFS=: read -r shape wt depths <<< "$run"
        log "sfi-gguf bench --kv-on-host: the KV cache in host memory ($shape shape, $wt, depths $depths)"
        # (the output as it comes, also into $OUT: a run cut short by the call's limit still tells how far it got)
        python3 -m sfi_gguf.cli bench -m $shape --weight-type $wt --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
            --kv-on-host --depths ${depths//,/ } -n ${SFI_BENCH_N:-128} ${SFI_BENCH_ARGS:-} \
            --json "$OUT/bench-h200-$shape-$wt-kv-on-host${SFI_BENCH_TAG:-}.json" 2>&1 | grep --line-buffered -v "^load:" \
            | tee -a "$OUT/kv-on-host.log"
    done
fi
if [[ " $stages " == *" keep-graphs-bench "* ]]; then
    # graph keeping on and off: single sequence (a variant on the same context) at $SFI_BENCH_DEPTHS, and
    # $SFI_KEEP_BATCHES (default 4:32768) batched, refreshes synchronised and staggered (--stagger 1)
    log "sfi-gguf bench: graph keeping on and off (Qwen3-4B shape, F16)"
    python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
        --depths ${SFI_BENCH_DEPTHS:-32768 131072} -n ${SFI_BENCH_N:-256} --variant keep_graphs=off \
        --json "$OUT/bench-h200-qwen3-4b-f16-keep-graphs${SFI_BENCH_TAG:-}.json" 2>&1 | grep --line-buffered -v "^load:" \
        | tee -a "$OUT/keep-graphs.log"
    for bd in ${SFI_KEEP_BATCHES:-4:32768}; do
        b=${bd%%:*}; d=${bd##*:}
        for stagger in 0 1; do
            for keep in on off; do
                python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
                    --batch "$b" --depths "$d" -n ${SFI_BENCH_N:-256} --stagger $stagger --keep-graphs $keep \
                    --json "$OUT/bench-h200-qwen3-4b-f16-batch$b-$d-stagger$stagger-keep-graphs-$keep${SFI_BENCH_TAG:-}.json" \
                    2>&1 | grep --line-buffered -v "^load:" | tee -a "$OUT/keep-graphs.log" | tail -2
            done
        done
    done
fi
if [[ " $stages " == *" host-profile "* ]]; then
    log "where the host's time goes in sfi-gguf bench (py-spy --native; benchmarks/host_profile.py; Qwen3-4B shape, F16)"
    for d in ${SFI_PROFILE_DEPTHS:-32768 131072}; do
        py-spy record --native -r ${SFI_PROFILE_RATE:-100} -f raw -o "$OUT/host-$d.txt" -- python3 -m sfi_gguf.cli bench -m qwen3-4b \
            --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 --depths $d -n ${SFI_BENCH_N:-256} \
            ${SFI_BENCH_ARGS:-} 2>&1 | grep -v "^load:" | tail -2
        python3 benchmarks/host_profile.py "$OUT/host-$d.txt" --rate ${SFI_PROFILE_RATE:-100} --root "SFIStepper\.step" \
            --root "DenseStepper\.step" --root "BatchedDecoder\.step" --root "LlamaContext\.last_logits" --top 30 \
            --json "$OUT/host_profile-h200-qwen3-4b-$d.json" > "$OUT/host_profile-$d.txt"
        head -120 "$OUT/host_profile-$d.txt"
        gzip -f "$OUT/host-$d.txt"  # the raw stacks come back too (benchmarks/host_profile.py reads them unpacked)
    done
fi
if [[ " $stages " == *" batched-tests "* ]]; then
    log "batched SFI tests on the GPU (one KV stream per sequence)"
    SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider tests/test_batched_native.py \
        2>&1 | tee "$OUT/gpu-batched-tests.log" | tail -5
fi
if [[ " $stages " == *" batched-bench "* ]]; then
    # SFI_BATCHES: "sequences:depth ..." (default: the issue's 16 x 32K and 8 x 16K; 4 x 128K as its own call)
    for bd in ${SFI_BATCHES:-8:16384 16:32768}; do
        b=${bd%%:*}; d=${bd##*:}
        log "sfi-gguf bench: $b sequences x $d (Qwen3-4B shape, F16)"
        python3 -m sfi_gguf.cli bench -m qwen3-4b --weight-type f16 --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
            --batch "$b" --depths "$d" -n ${SFI_BENCH_N:-256} --min-context ${SFI_MIN_CONTEXT:-8192} \
            ${SFI_BENCH_ARGS:-} --json "$OUT/bench-h200-qwen3-4b-f16-batch$b-$d${SFI_BENCH_TAG:-}.json" 2>&1 | grep -v "^load:" | tail -4
    done
fi
if [[ " $stages " == *" multigpu-tests "* ]]; then
    log "multi-GPU tests: layer split over 2 GPUs ($(nvidia-smi -L | wc -l) GPUs on this host)"
    SFI_TEST_GPUS=2 SFI_VOCAB_SOURCE=$PWD/.gpu/vocab.gguf python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_multi_gpu.py 2>&1 | tee "$OUT/multigpu-tests.log" | tail -15
    log "native tests, layers split over 2 GPUs (llama.cpp's default layer split)"
    SFI_TEST_GPUS=2 SFI_TEST_NGL=99 python3 -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_native.py \
        2>&1 | tee "$OUT/multigpu-native-tests.log" | tail -15
fi
if [[ " $stages " == *" multigpu-bench "* ]]; then
    bench8b() {  # same model, depths and options on 2 GPUs and on 1; the JSON rows say split_mode and n_gpus
        local tag=$1; shift
        python3 -m sfi_gguf.cli bench -m qwen3-8b --weight-type q4_k_m --vocab-source "$PWD/.gpu/vocab.gguf" -ngl 99 \
            --depths ${SFI_BENCH_DEPTHS:-32768 131072} -n ${SFI_BENCH_N:-256} "$@" \
            --json "$OUT/bench-h200$tag-qwen3-8b-q4_k_m.json" 2>&1 | grep -v "^load:" | tail -8
    }
    log "sfi-gguf bench: Qwen3-8B shape Q4_K_M, layers split over 2 GPUs"
    bench8b x2 --split-mode layer
    log "sfi-gguf bench: Qwen3-8B shape Q4_K_M, 1 GPU"
    CUDA_VISIBLE_DEVICES=0 bench8b x1 --split-mode none
fi
# the device tool brings back at most 8 files: more than that go back as one archive (tar xzf results.tgz)
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
    (cd "$OUT" && find . -type f ! -name results.tgz ! -name .files -printf '%P\n' > .files && tar czf results.tgz -T .files \
        && xargs -d '\n' rm -f < .files && rm -f .files)
fi
log done
