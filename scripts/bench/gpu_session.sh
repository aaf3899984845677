#!/usr/bin/env bash
# Issue #38's measurements on one lent GPU host (16 cores), in one command: the train step's MFU
# (profiled), cuDNN attention's tests, the whole app on a RedPajama-v2-shaped corpus, and the
# input pipeline on the host's cores. Every part writes under $OUT as it goes; a part that fails
# leaves a line saying so and the others run.
#
#   bash scripts/bench/gpu_session.sh                      # on the GPU host, from the repo root
#   SMOKE=1 OUT=/tmp/gs bash scripts/bench/gpu_session.sh  # the same steps at toy sizes on a CPU
#
# Needs, beside the checkout: .gpu/ holding ../shared/bench's make_corpus.py, pool_en.txt.gz and
# llama_style_tokenizer.json (the corpus is written on the host: 4 x 150 MB of text), and, where
# the host lacks grain/hydra/..., .whl/ (../shared/device/prepare.sh). Knobs (environment):
#   BUDGET=480        seconds the whole script may take; later parts are skipped when short
#   ROUND=1|2|3|4|5   the MFU tries: 1 = the first round, 2 = the variants, 3 = cuDNN's packed layout,
#                     4 = the packed step without remat, 5 = model.fp8 against bf16 (bench_mfu.py's plan).
#                     Round 5 also runs tests/test_fp8.py on the GPU (the fp8 GEMMs in the compiled step,
#                     the numbers against explicitly quantized operands; SKIP=fp8 leaves it out). FP8 alone,
#                     within the default BUDGET: ROUND=5 ATTN=0 SKIP=input,app,cudnn bash scripts/bench/gpu_session.sh
#   APP_PACKED=M      the app's model.cudnn_packed_segments (default 16 in round 3, else 0)
#   ATTN=0            leave out bench_attention.py (the attention kernels alone, before the MFU tries)
#   HEAD_WORKERS=8    bench_head.py's worker share (the head batch alone); empty: leave it out
#   IN_ARGS_A/B/C/D/E=... bench_input.py's runs (empty: leave one out); CONVERT_THREADS="1 4 14"
#                     (A-D read 4 files of 36,000 documents; E the same documents in 64 files, as a
#                     bucket of many files is read: no file shared by several virtual shards)
#   FIRST_CORPORA="/tmp/rpb /tmp/rp"  bench_first_batches.py's corpora (data.head_batch's ways to the
#                     first batches); empty: leave it out
#   FIRST_MODES=race,first,off  FIRST_REPS=1   bench_first_batches.py's modes and rounds
#   HEAD_RAYON=1      also the head batch alone with its tokenizer calls on the Rayon pool (the old way)
#   HEAD_SWITCH="0.001 0.0005"  also the head batch alone at these GIL switch intervals (Python's: 0.005)
#   HEAD_PROFILE=1    py-spy profiles of the head batch (the trainer process), every thread and the GIL
#                     (HEAD_PROFILE=gil: the GIL's holder only)
#   TRIES=a,b         the MFU tries by name (overrides ROUND)
#   APP_REMAT=...     the app's model.remat (default: the faster of the 1b seq-2048 tries that ran)
#   SKIP=input,app,cudnn,mfu,fp8   parts to leave out
#   CUDNN_K=expr      only the cuDNN tests matching this pytest -k expression
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-480}
SKIP=${SKIP:-}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/session.log"; }
skip() { [[ ",$SKIP," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1

if [ "${SMOKE:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
PY=${PY:-python3}
TOK=$PWD/.gpu/llama_style_tokenizer.json
NCPU=$(nproc)

if [ "${SMOKE:-0}" = 1 ]; then
    DOCS=300; SMALL_DOCS=200; PLAN=cpu; TRIES=${TRIES:-tiny_b16$([ "${ROUND:-1}" = 5 ] && echo ,tiny_b16_fp8)}; SEQ=256; APP_STEPS=30; APP_MODEL="model=tiny model.vocab_size=32000"
    IN_ARGS_A="--workers 1,2 --max-batches 20"; IN_ARGS_B="--workers 2 --max-batches 20"; IN_ARGS_C=""
    IN_ARGS_D="--workers 2 --max-batches 20 --sim-steps 5 --worker-nice 10"
    IN_ARGS_E="--paths /tmp/rpb/*/en_head.json.gz --workers 2 --max-batches 20 --sim-steps 5 --worker-nice 10"
    CONVERT_THREADS="1 2"; IN_BATCH=8; GPU_CORES=""; IN_CORES=""; WARMUP_S=0
    export BENCH_MFU_DEVICE_PREFIX=/host:CPU
else
    DOCS=36000; SMALL_DOCS=4000; PLAN=gpu; SEQ=2048; APP_STEPS=60; APP_MODEL=""
    if [ "${ROUND:-1}" = 5 ]; then
        # model.fp8 (docs/gpus.md "FP8 matmuls"): each fp8 try after its bf16 baseline, the same process
        # setup on the same GPU; the 1b first (the round's answer), then Llama-3.2-1B's shapes.
        APP_PACKED=${APP_PACKED:-8}
        TRIES=${TRIES:-1b_s2048_cudnn_dotsattn_b16_packed8,1b_s2048_cudnn_dotsattn_b16_packed8_fp8,llama3_2_1b_s2048_cudnn_none_b8_packed8,llama3_2_1b_s2048_cudnn_none_b8_packed8_fp8}
    elif [ "${ROUND:-1}" = 4 ]; then
        APP_PACKED=${APP_PACKED:-8}
        TRIES=${TRIES:-1b_s2048_cudnn_dotsattn_b16_packed8,1b_s2048_cudnn_none_b12_packed8,1b_s2048_cudnn_none_b8_packed8}
    elif [ "${ROUND:-1}" = 3 ]; then
        APP_PACKED=${APP_PACKED:-16}
        TRIES=${TRIES:-1b_s2048_cudnn_dotsattn_b16,1b_s2048_cudnn_dotsattn_b16_packed8,1b_s2048_cudnn_dotsattn_b16_packed16,1b_s2048_cudnn_dotsattn_b24_packed16,llama3_2_1b_s2048_cudnn_none_b8_packed16,1b_s1024_cudnn_dotsattn_b32_packed16}
    elif [ "${ROUND:-1}" = 2 ]; then
        TRIES=${TRIES:-1b_s2048_cudnn_dotsattn_b16,1b_s2048_cudnn_dots_b16_bf16head,llama3_2_1b_s2048_cudnn_none_b8_bf16head,1b_s2048_cudnn_dotsattn_b16_notriton,125m_s2048_cudnn_none_b32,125m_s1024_cudnn_none_b64,1b_s1024_cudnn_dotsattn_b32,1b_s2048_cudnn_dotsattn_b24}
    else
        TRIES=${TRIES:-1b_s2048_cudnn_none_b16,1b_s2048_cudnn_dots_b16,1b_s2048_xla_dots_b16,llama3_2_1b_s2048_cudnn_none_b8,1b_s1024_cudnn_none_b32,125m_s2048_cudnn_none_b32,125m_s1024_cudnn_none_b64}
    fi
    # 56 rows: a multiple of 1, 2, 4, 8 and 14 workers, so every worker count splits the virtual
    # shards evenly (one shard per row).
    IN_BATCH=56
    # Each count's run long enough past its workers' start (--warmup-s) for a steady rate; the
    # restore figure is at the largest count of a line: 8 workers (B).
    # (each can be set, or set empty to leave it out: IN_ARGS_A= ...)
    # B reads 160 M characters a count (the common 40 M left the second session 2.1-2.2 s of steady
    # rate after the warm-up at 8 workers: its 0.77-0.88 against the first session's 0.93).
    IN_ARGS_A=${IN_ARGS_A-"--workers 1,2 --max-batches 150"}; IN_ARGS_B=${IN_ARGS_B-"--workers 4,8 --max-batches 600 --max-chars 160e6"}
    IN_ARGS_C=${IN_ARGS_C-"--workers 14 --max-batches 1000"}
    # D: first batch and restore with train.py's worker_nice (10: the trainer's head batch is
    # scheduled before the workers' start); A-C run the workers at the trainer's priority (0), as
    # the first sessions' ratios did.
    IN_ARGS_D=${IN_ARGS_D-"--workers 8 --max-batches 200 --sim-steps 20 --worker-nice 10"}
    # E: D on the bucket-shaped corpus (64 files: every virtual shard reads files of its own; in the
    # 4-file corpus 14 shards share each file, and each decompresses the whole of it).
    IN_ARGS_E=${IN_ARGS_E-"--paths /tmp/rpb/*/en_head.json.gz --workers 8 --max-batches 200 --sim-steps 20 --worker-nice 10"}
    WARMUP_S=3
    CONVERT_THREADS=${CONVERT_THREADS-"1 4 14"}
    # The GPU's process keeps 2 cores (its loop, launch threads and compiles); the input runs on the
    # other 14 while the GPU part runs, as a training host shares them.
    if [ "$NCPU" -ge 16 ] && ! skip input; then GPU_CORES="taskset -c 0,1"; IN_CORES="taskset -c 2-$((NCPU - 1))"; else GPU_CORES=""; IN_CORES=""; fi
fi

say "host: $NCPU cores, $(free -g | awk '/Mem:/{print $2}') GB; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
say "cpu: $(lscpu 2>/dev/null | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))' | sed 's/  */ /g' | paste -sd';')"
$PY -c "import jax, jaxlib, flax, optax, orbax.checkpoint as o, grain, tokenizers; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'grain', getattr(grain, '__version__', '?'), 'tokenizers', tokenizers.__version__, jax.devices())" 2>&1 | tee -a "$OUT/session.log"

# Nothing below can run without the project importing: stop at once (a cold start is the cost).
$PY -c "import train, model.llama, model.step, data" 2>&1 | tail -3 | tee -a "$OUT/session.log"
[ "${PIPESTATUS[0]}" = 0 ] || { say "the project does not import here; stopping"; exit 1; }
# JAX takes 75% of the GPU by default; the plans are sized to 90% (bench_mfu.py does the same).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

# bench_first_batches.py on $corpus with $fw workers and a state $fd batches deep (the caller's),
# logged under LABEL:  first_batches LABEL [VAR=value ...] -- [its other arguments]
first_batches() {
    local label=$1; shift
    local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
    say "bench_first_batches on $corpus ($label): $fw workers"
    env ${envs[@]+"${envs[@]}"} $IN_CORES $PY scripts/bench/bench_first_batches.py --paths "$corpus/*/en_head.json.gz" \
        --tokenizer $TOK --seq-len $SEQ --batch-size $IN_BATCH --num-shards $IN_BATCH --workers $fw \
        --deep-batches $fd "$@" > "/tmp/first_$label.log" 2>&1 \
        || say "bench_first_batches ($label) failed: $(tail -1 "/tmp/first_$label.log")"
    { echo "=== bench_first_batches $corpus $label"; cat "/tmp/first_$label.log"; } >> "$OUT/input.log"
    grep "^round" "/tmp/first_$label.log" | tee -a "$OUT/session.log"
}

# ---- input side (background): the corpus, then the input benchmarks on the input cores ----
input_part() {
    skip input && skip app && return
    # The input's processes import JAX too: left to preallocate, they claimed GPU memory beside the
    # MFU tries (seen in the first session: their allocator retried down from 71 GB). On demand only.
    local XLA_PYTHON_CLIENT_PREALLOCATE=false; export XLA_PYTHON_CLIENT_PREALLOCATE
    local t=$(date +%s)
    for i in 0 1 2 3; do $PY .gpu/make_corpus.py /tmp/rp_$i --shards 1 --docs $DOCS --seed $i >/dev/null & done
    $PY .gpu/make_corpus.py /tmp/rp_small --shards 2 --docs $SMALL_DOCS --seed 9 >/dev/null &
    wait
    mkdir -p /tmp/rp && for i in 0 1 2 3; do mv /tmp/rp_$i/0000 /tmp/rp/000$i; done
    # The same documents in 64 files (each file's lines dealt to 16), one process per file.
    for i in 0 1 2 3; do $PY -c "
import gzip, os, sys
i = int(sys.argv[1])
outs = []
for r in range(16):
    os.makedirs(f'/tmp/rpb/{i * 16 + r:04d}', exist_ok=True)
    outs.append(gzip.open(f'/tmp/rpb/{i * 16 + r:04d}/en_head.json.gz', 'wt', compresslevel=6))
with gzip.open(f'/tmp/rp/{i:04d}/en_head.json.gz', 'rt') as f:
    for n, line in enumerate(f):
        outs[n % 16].write(line)
for o in outs:
    o.close()
" $i & done
    wait
    say "corpus: $(du -sh /tmp/rp | cut -f1) in 4 shards (and in 64: /tmp/rpb), written in $(( $(date +%s) - t )) s"
    touch /tmp/rp.ready
    skip input && return
    local common="--paths /tmp/rp/*/en_head.json.gz --tokenizer $TOK --seq-len $SEQ --batch-size $IN_BATCH --num-shards $IN_BATCH --rounds 1 --max-chars 40e6 --pair-chars 10e6 --sim-steps 200 --warmup-s $WARMUP_S --worker-nice 0"
    for part in A B C D E; do
        local a_var="IN_ARGS_$part"; [ -z "${!a_var}" ] && continue
        say "bench_input $part: ${!a_var}"
        $IN_CORES $PY scripts/bench/bench_input.py $common ${!a_var} > /tmp/input_$part.log 2>&1 \
            || say "bench_input $part failed: $(tail -1 /tmp/input_$part.log)"
        { echo "=== bench_input $part: ${!a_var}"; cat /tmp/input_$part.log; } >> "$OUT/input.log"
        tail -1 /tmp/input_$part.log >> "$OUT/input.jsonl"
    done
    for corpus in ${FIRST_CORPORA-/tmp/rpb /tmp/rp}; do
        # Each way of making the first batch (data.head_batch): seconds to the first batches,
        # fresh and after a deep restore, at train.py's worker_nice.
        local fw=8 fb=10 fd=60; [ "${SMOKE:-0}" = 1 ] && { fw=2; fb=4; fd=6; }
        first_batches all -- --batches $fb --modes ${FIRST_MODES:-race,first,off} --reps ${FIRST_REPS:-1}
        # the head batch alone with its calls on the tokenizer's Rayon pool (the way before
        # data/tokenizer.py serial_calls_unless_set), against the serial calls just above
        [ "${HEAD_RAYON:-0}" = 1 ] && first_batches rayon TOKENIZERS_PARALLELISM=true -- --batches 1 --modes first
        for si in ${HEAD_SWITCH:-}; do
            first_batches "switch_$si" -- --batches 1 --modes first --reps ${FIRST_REPS:-1} --switch-interval $si
        done
    done
    if [ "${HEAD_PROFILE:-0}" != 0 ]; then
        # Where the head batch's wall time goes on this host's cores: py-spy (in .whl) samples the
        # trainer process (not the workers) making the first batch and the one after a deep restore
        # with data.head_batch=first, once every thread and once only the GIL's holder. Collapsed
        # stacks (--format raw): scripts/bench/profile_stacks.py reads them.
        local pyspy; pyspy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
        local fw=8 fd=60; [ "${SMOKE:-0}" = 1 ] && { fw=2; fd=6; }
        local hows="all gil"; [ "$HEAD_PROFILE" = gil ] && hows=gil
        for how in $hows; do
            local flag="--threads --idle"; [ $how = gil ] && flag="--threads --gil"
            say "head profile ($how): py-spy on bench_first_batches --modes first"
            $IN_CORES $pyspy record --format raw -r 200 --nonblocking $flag -o "$OUT/head_$how.txt" -- \
                $PY scripts/bench/bench_first_batches.py --paths "/tmp/rpb/*/en_head.json.gz" --tokenizer $TOK \
                --seq-len $SEQ --batch-size $IN_BATCH --num-shards $IN_BATCH --workers $fw --batches 1 \
                --deep-batches $fd --modes first > /tmp/head_prof.log 2>&1 || say "head profile failed: $(tail -1 /tmp/head_prof.log)"
            grep "^round" /tmp/head_prof.log | tee -a "$OUT/session.log"
            $PY scripts/bench/profile_stacks.py "$OUT/head_$how.txt" --top 12 2>&1 | tee -a "$OUT/session.log"
        done
    fi
    if [ -n "${HEAD_WORKERS-8}" ]; then
        # The head batch alone (the first batch and the one after a restore, as the trainer makes
        # them while its workers start): a worker's share of the cores against all of them.
        local hw=${HEAD_WORKERS-8}; [ "${SMOKE:-0}" = 1 ] && hw=2
        say "bench_head: $hw workers' share against all cores"
        $IN_CORES $PY scripts/bench/bench_head.py --paths /tmp/rp/*/en_head.json.gz --tokenizer $TOK --seq-len $SEQ \
            --batch-size $IN_BATCH --num-shards $IN_BATCH --workers $hw > /tmp/head.log 2>&1 \
            || say "bench_head failed: $(tail -1 /tmp/head.log)"
        { echo "=== bench_head: $hw workers"; cat /tmp/head.log; } >> "$OUT/input.log"
        say "bench_head: $(tail -1 /tmp/head.log | cut -c1-600)"
    fi
    for n in $CONVERT_THREADS; do
        rm -rf /tmp/rp_conv
        local cores=""; [ -n "$IN_CORES" ] && cores="taskset -c 2-$((1 + n))"
        say "convert with $n thread(s): $($cores $PY scripts/prepare_data.py --paths '/tmp/rp_small/*/en_head.json.gz' --tokenizer $TOK --out /tmp/rp_conv --no-progress 2>&1 | grep -o 'converted.*tokens/s)')"
    done
}
input_part &
INPUT_PID=$!

# ---- GPU side: the step's MFU (profiled), cuDNN attention's tests, the app ----
mfu() {  # mfu NAMES TIMEOUT
    skip mfu && return
    [ "$(left)" -lt 90 ] && { say "mfu $1: skipped, $(left) s left"; return; }
    say "mfu: $1"
    timeout "$2" $GPU_CORES $PY scripts/bench/bench_mfu.py --plan $PLAN --names "$1" --out "$OUT/mfu.jsonl" \
        --profile-dir /tmp/prof --timeout-s 170 >> "$OUT/mfu.log" 2>&1 || say "mfu: stopped ($?)"
    grep -E "step [0-9.]+ s|failed|timeout|out of memory" "$OUT/mfu.log" > /tmp/mfu_table.txt
}
if [ "${ATTN:-1}" = 1 ] && ! skip mfu; then
    say "bench_attention: the kernels alone"
    if [ "${SMOKE:-0}" = 1 ]; then ATTN_ARGS="--batch 2 --seq 128 --heads 4 --kv-heads 2 --iters 2"; else ATTN_ARGS=""; fi
    timeout 150 $GPU_CORES $PY scripts/bench/bench_attention.py $ATTN_ARGS > "$OUT/attention.jsonl" 2> /tmp/attention.err \
        || say "bench_attention: exit $? ($(grep -v '^E0000\|^W0000' /tmp/attention.err | tail -1))"
    $PY - "$OUT/attention.jsonl" <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "fixes" in r:
        print("  ", r); continue
    print(f"  {r['variant']:>16}: {r['status']:6} {r.get('fwd_bwd_ms', '-'):>8} ms {r.get('causal_tflops', '-'):>6} TFLOP/s "
          f"max_runs {r['max_runs']} rel_err {r.get('rel_err', '-')} {r.get('error', '')}")
EOF
fi

IFS=, read -ra ALL <<< "$TRIES"
FIRST=$(IFS=,; echo "${ALL[*]:0:3}"); REST=$(IFS=,; echo "${ALL[*]:3}")
mfu "$FIRST" $(( $(left) - 200 ))

if ! skip cudnn && [ "$(left)" -gt 120 ]; then
    say "cudnn tests"
    JAX_PLATFORMS=${SMOKE_PLATFORM:-$([ "${SMOKE:-0}" = 1 ] && echo cpu || echo cuda)} timeout 150 $GPU_CORES \
        $PY -m pytest tests/test_attention_cudnn.py -q -p no:cacheprovider -n 0 -rs ${CUDNN_K:+-k "$CUDNN_K"} > "$OUT/cudnn.log" 2>&1
    say "cudnn tests: $(tail -1 "$OUT/cudnn.log")"
fi

app() {  # app NAME STEPS WORKERS
    skip app && return
    [ "$(left)" -lt 100 ] && { say "app $1: skipped, $(left) s left"; return; }
    while [ ! -e /tmp/rp.ready ]; do sleep 2; done
    if [ -z "${APP_REMAT:-}" ]; then
        APP_REMAT=$($PY - "$OUT/mfu.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
ok = [r for r in rows if r.get("status") == "ok" and r.get("preset") == "1b" and r.get("seq") == 2048]
print(max(ok, key=lambda r: r["tokens_per_s"])["remat"] if ok else "dots")
EOF
)
    fi
    say "app $1: steps $2, data.num_workers=$3, model.remat=$APP_REMAT, model.cudnn_packed_segments=${APP_PACKED:-0}"
    timeout $(( $(left) - 10 )) $PY train.py experiment=gpu_8_llama_1b $APP_MODEL model.remat=$APP_REMAT \
        model.cudnn_packed_segments=${APP_PACKED:-0} name=$1 paths.run_dir=/tmp/$1 \
        "data.paths=[/tmp/rp/*/en_head.json.gz]" tokenizer.path=$TOK data.global_batch_size=16 data.num_shards=16 \
        data.seq_len=$SEQ data.eval.holdout_files=0 train.microbatches=1 train.steps=$2 train.log_every=10 \
        train.eval_every=0 data.num_workers=$3 logger.wandb.mode=disabled logger.progress_bar=false \
        "profile.steps=[$(( $2 - 12 )),$(( $2 - 10 ))]" > /tmp/$1.log 2>&1 || say "app $1: exit $?"
    { echo "=== app $1"; cat /tmp/$1.log; } >> "$OUT/app.log"
    grep -E "^(step|data.num_workers|Goodput|Badput|Done|model.attention|model.cudnn)" /tmp/$1.log | tail -12 | tee -a "$OUT/session.log"
    $PY - "/tmp/$1/metrics.jsonl" <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
rows = [r for r in rows if "step_time_s" in r]
for r in rows:
    print(f"  step {r['step']}: step_time {r['step_time_s']:.4f} s, tok/s {r['tokens_per_s']:,.0f}, mfu {r.get('mfu')}, "
          f"data_wait_frac {r.get('data_wait_frac', 0):.4f}, workers {r.get('data/auto_num_workers', '-')}, "
          f"bound {r.get('input/bound')}, checkpoint_save_s {r.get('checkpoint_save_s')}")
EOF
    $PY scripts/bench/profile_top.py "/tmp/$1/profile" --steps 3 --top 10 --device-prefix "${BENCH_MFU_DEVICE_PREFIX:-/device:GPU}" \
        >> "$OUT/profiles.txt" 2>&1
}

wait $INPUT_PID   # the app's input workers need the cores the input benchmarks use
app app_auto $APP_STEPS auto
[ -n "$REST" ] && mfu "$REST" $(( $(left) - $(skip app && echo 5 || echo 80) ))
app app_w${APP_FIXED:-1} $(( APP_STEPS / 2 )) ${APP_FIXED:-1}

if [ "${ROUND:-1}" = 5 ] && ! skip fp8 && [ "$(left)" -gt 100 ]; then
    say "fp8 tests (after the tries: they are the measurement)"
    JAX_PLATFORMS=${SMOKE_PLATFORM:-$([ "${SMOKE:-0}" = 1 ] && echo cpu || echo cuda)} timeout 150 $GPU_CORES \
        $PY -m pytest tests/test_fp8.py -m "not slow" -q -p no:cacheprovider -n 0 -rs > "$OUT/fp8.log" 2>&1
    say "fp8 tests: $(tail -1 "$OUT/fp8.log")"
fi

grep -h -A40 "^--- profile" "$OUT/mfu.log" >> "$OUT/profiles.txt" 2>/dev/null
say "done; MFU tries:"
cat /tmp/mfu_table.txt | tee -a "$OUT/session.log"
$PY - "$OUT/input.jsonl" <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import json, sys, os
if not os.path.exists(sys.argv[1]):
    sys.exit()
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    keys = ["tokenizer_tok_s", "pipeline_tok_s", "pipeline_vs_tokenizer", "cpu_efficiency_paired", "first_batch_s",
            "restore_s", "peak_rss_mb", "sim_wait_frac"]
    print("input:", json.dumps({k: r.get(k) for k in keys}))
EOF
