#!/usr/bin/env bash
# The multi-GPU benchmarks in one command on one node: the X-MoE paper's 8-GPU experiments (whole-model throughput,
# xmoe vs the padded baseline; SSMB; RBD; EP vs one-GPU loss curves). See docs/benchmarks-multi-gpu.md.
#
#   bash benchmarks/run_multi_gpu.sh [--out DIR] [--gpus N] [--steps S]   # GPUs: N defaults to all visible ones
#   bash benchmarks/run_multi_gpu.sh --cpu [--out DIR]                   # CPU smoke test (4 gloo ranks, tiny)
#
# DIR defaults to benchmarks/results/multi_gpu. Parts, each under its own `timeout` so that one hang cannot eat the
# others' time (8 GPUs, estimated / cap):
#   0 plans   xmoe plan memory / comm predictions, on the host, in the background      ~10 s / 60 s
#   1 table   bench_train_multi_gpu.py: small 2048x28, 1024x28, 2048x14; xmoe vs padded, both EP=W ~220 s / 235 s
#   2 ssmb    bench_train_multi_gpu.py --mode ssmb: TP=2 x EP=W/2, SSMB on vs off (2048x28)   ~90 s / 100 s
#   3 rbd     bench_rbd.py --gpus-per-node W/2 (2 virtual nodes), small shape        ~45 s / 70 s
#   4 loss    tiny preset, STEPS steps: EP=W under torchrun and 1 GPU, concurrently  ~60 s / 90 s
# Worst case 495 s + a few seconds of assembly. Files in DIR: train_multi_gpu_table.{json,md},
# train_multi_gpu_ssmb.{json,md}, bench_rbd.{json,md}, multi_gpu_loss.json, multi_gpu_summary.md (plans, loss
# comparison, part exit codes / times, the log tails of failed parts). Full logs and run directories stay in a
# scratch folder, printed at the end.
set -u
cd "$(dirname "$0")/.."
# NVLink multicast (NVLS) off unless asked for: it needs fabric-manager support that not every host has
export PYTHONPATH=. NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
CPU=0; RESULTS=benchmarks/results/multi_gpu; NGPU=""; STEPS=""
ARGS="$*"
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) CPU=1; shift ;;
        --out) RESULTS=$2; shift 2 ;;
        --gpus) NGPU=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        *) echo "run_multi_gpu: unknown argument $1 (expected --cpu, --out DIR, --gpus N, --steps S)"; exit 2 ;;
    esac
done
mkdir -p "$RESULTS"
export XMOE_RESULTS_DIR=$RESULTS  # the benchmarks write their json + md files there (benchmarks/harness.py)
W=$(mktemp -d /tmp/xmoe-multi-gpu.XXXXXX)
T0=$(date +%s)

if [ $CPU = 1 ]; then
    NP=4; FLAG=--cpu; DEV="--device cpu"; STEPS=${STEPS:-40}
    TABLE_ARGS="--micro-batches 1 2"; SSMB_ARGS="--micro-batches 1"; CAPS=(120 90 90 120)
    export OMP_NUM_THREADS=1
else
    NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    if [ "$NGPU" -ge 8 ]; then NP=8; elif [ "$NGPU" -ge 4 ]; then NP=4; elif [ "$NGPU" -ge 2 ]; then NP=2
    else echo "run_multi_gpu: needs >= 2 GPUs, found ${NGPU}"; exit 1; fi
    FLAG=""; DEV=""; STEPS=${STEPS:-300}
    TABLE_ARGS="--case-budget-s 33"; SSMB_ARGS="--case-budget-s 35 --micro-batches 1 2 4 8 16"
    CAPS=(235 100 70 90)
fi
GPN=$((NP / 2))  # two virtual nodes for RBD
TORCHRUN="torchrun --standalone --nproc-per-node $NP"
echo "| part | exit | seconds | cap | command |" > "$W/parts.md"
echo "|---|---|---|---|---|" >> "$W/parts.md"

part() {  # part NAME CAP_S COMMAND...: run under timeout, log to $W/NAME.log, record exit code and time
    local name=$1 cap=$2 start rc
    shift 2
    start=$(date +%s)
    echo "[$(( start - T0 )) s] $name: $*"
    timeout --kill-after=15 "$cap" "$@" > "$W/$name.log" 2>&1
    rc=$?
    echo "| $name | $rc$([ $rc = 124 ] && echo ' (timeout)') | $(( $(date +%s) - start )) | $cap | \`$*\` |" >> "$W/parts.md"
    if [ $rc != 0 ]; then
        { echo; echo "### $name: exit $rc, last lines of its log"; echo '```'; tail -n 30 "$W/$name.log"; echo '```'; } \
            >> "$W/failures.md"
    fi
    return 0
}

# 0. predictions (host only, in the background while the GPUs work)
(
    for args in "--tp 1 --ep $NP" "--tp 1 --ep $NP --padded" "--tp 2 --ep $GPN" "--tp 2 --ep $GPN --no-ssmb"; do
        echo "\$ python -m xmoe plan memory --preset small --gpus $NP --gpu-mem 141 --recompute none $args"
        timeout 60 python -m xmoe plan memory --preset small --gpus $NP --gpu-mem 141 --recompute none $args 2>&1 \
            | head -n 14
        echo
    done
    echo "\$ python -m xmoe plan comm --preset small --gpus $NP --gpus-per-node $GPN --ep $NP"
    timeout 60 python -m xmoe plan comm --preset small --gpus $NP --gpus-per-node $GPN --ep $NP 2>&1
) > "$W/plans.log" 2>&1 &
PLANS=$!

# 1-3. benchmarks (each writes its json + md into $RESULTS itself)
part table ${CAPS[0]} $TORCHRUN benchmarks/bench_train_multi_gpu.py $FLAG $TABLE_ARGS
part ssmb ${CAPS[1]} $TORCHRUN benchmarks/bench_train_multi_gpu.py --mode ssmb $FLAG $SSMB_ARGS
part rbd ${CAPS[2]} $TORCHRUN benchmarks/bench_rbd.py --gpus-per-node $GPN $FLAG $([ $CPU = 0 ] && echo --shapes small)

# 4. loss curves: same tiny model, seed, data and global batch (16 sequences); EP=NP vs one process. Run together:
# only the losses are compared, so sharing GPU 0 costs nothing that matters
TRAIN="-m xmoe train --steps $STEPS --batch-size 16 --log-every 10 --ckpt-every 0 $DEV"
part loss_single ${CAPS[3]} env CUDA_VISIBLE_DEVICES=0 python $TRAIN --out "$W/loss_single" &
LS=$!
part loss_ep ${CAPS[3]} $TORCHRUN $TRAIN --ep $NP --out "$W/loss_ep"
wait $LS
python - "$W" "$RESULTS" "$NP" <<'EOF' > "$W/loss.md" 2>&1
import json, sys
from pathlib import Path
w, out, np_ = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def curve(name):
    f = w / name / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, f.read_text().splitlines()) if "loss" in r} if f.exists() else {}
single, ep = curve("loss_single"), curve("loss_ep")
steps = sorted(set(single) & set(ep))
rel = {s: abs(ep[s] - single[s]) / abs(single[s]) for s in steps}
last = steps[-5:]
res = {"ep": np_, "steps_compared": len(steps),
       "max_rel_diff": max(rel.values()) if rel else None,
       "max_rel_diff_step": max(rel, key=rel.get) if rel else None,
       "final_single": single[steps[-1]] if steps else None, "final_ep": ep[steps[-1]] if steps else None,
       "mean_rel_diff_last5": sum(rel[s] for s in last) / len(last) if last else None,
       "curve_single": single, "curve_ep": ep}
from benchmarks.harness import commit
res.update(commit())
(out / "multi_gpu_loss.json").write_text(json.dumps(res, indent=1))
print(f"loss, tiny preset, global batch 16, EP={np_} vs 1 GPU: {len(steps)} logged steps compared, "
      f"max relative difference {res['max_rel_diff']} (step {res['max_rel_diff_step']}), "
      f"mean over the last 5 logged steps {res['mean_rel_diff_last5']}; final loss 1 GPU {res['final_single']}, "
      f"EP {res['final_ep']}")
EOF
wait $PLANS

# summary: the one markdown file that holds what the json / md files of the parts do not
S="$RESULTS/multi_gpu_summary.md"
{
    echo "# Multi-GPU benchmarks, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "GPUs: $([ $CPU = 1 ] && echo 'none (--cpu smoke test)' || nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs);" \
         "world $NP, RBD virtual nodes of $GPN; torch $(python -c 'import torch; print(torch.__version__)')"
    echo
    echo "Command: \`bash benchmarks/run_multi_gpu.sh $ARGS\` (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')); total $(( $(date +%s) - T0 )) s"
    echo
    echo "## Parts"; echo; cat "$W/parts.md"
    echo; echo "## Loss curves (multi_gpu_loss.json)"; echo; cat "$W/loss.md"
    for f in train_multi_gpu_table train_multi_gpu_ssmb bench_rbd; do
        echo; echo "## $f.md"; echo
        [ -f "$RESULTS/$f.md" ] && sed -n '1,40p' "$RESULTS/$f.md" || echo "(missing)"
    done
    echo; echo "## Predictions"; echo; echo '```'; cat "$W/plans.log"; echo '```'
    [ -f "$W/failures.md" ] && { echo; echo "## Failures"; cat "$W/failures.md"; }
} > "$S"

echo
echo "===== multi-GPU benchmarks summary ($(( $(date +%s) - T0 )) s; full logs in $W) ====="
cat "$W/parts.md"
cat "$W/loss.md"
for f in train_multi_gpu_table train_multi_gpu_ssmb; do
    # the first table of the file: the largest micro-batch per (variant, method)
    [ -f "$RESULTS/$f.md" ] && awk '/^\| variant/ {on = 1} on && !/^\|/ {exit} on' "$RESULTS/$f.md"
done
[ -f "$RESULTS/bench_rbd.md" ] && grep '^|' "$RESULTS/bench_rbd.md" | tail -n 4
echo "files in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
