#!/usr/bin/env bash
# The multi-GPU benchmarks in one command on one node: expert parallelism's overlap, FP8 dispatch and RBD over NCCL
# (each beside the planner), then the X-MoE paper's 8-GPU experiments (whole-model throughput, xmoe vs the padded
# baseline; SSMB; EP vs one-GPU loss curves). See docs/benchmarks-multi-gpu.md.
#
#   bash benchmarks/run_multi_gpu.sh [OUT_DIR [N]]                 # N GPUs (default: all visible; 8, 4 or 2 used)
#   bash benchmarks/run_multi_gpu.sh [--out DIR] [--gpus N] [--steps S] [--parts ep,rbd,overlap,table,ssmb,loss]
#   bash benchmarks/run_multi_gpu.sh --cpu [OUT_DIR]               # CPU smoke test (4 gloo ranks, tiny shapes)
#
# OUT_DIR defaults to benchmarks/results/multi_gpu. Parts, in this order, each under its own `timeout` so that one
# hang cannot eat the others' time (W = the GPUs used; caps in seconds on GPUs):
#   plans    xmoe plan memory / comm predictions, on the host, in the background                           cap 60
#   ep<P>    bench_ep.py at EP = P for P = 2, 4, 8 up to W: the routed layer, overlap off / shared / chunks x
#            dispatch bf16 / fp8, small and medium, 8192 and 16384 tokens per rank (P other than 2 and W:
#            16384 only), exposed all-to-all time, beside the one-GPU layer and the planner   cap 150 (80 reduced)
#   rbd      bench_rbd.py --gpus-per-node W/2 (2 virtual nodes), node limit off and M = 1, 8192 tokens   cap 90
#   overlap  bench_train_multi_gpu.py --mode overlap: the small model at EP = W, overlap off vs auto  cap 110
#   table    bench_train_multi_gpu.py: small 2048x28, 1024x28, 2048x14; xmoe vs padded, both EP = W     cap 235
#   ssmb     bench_train_multi_gpu.py --mode ssmb: TP=2 x EP=W/2, SSMB on vs off (2048x28)           cap 100
#   loss     tiny preset, S steps: EP = W under torchrun and 1 GPU, concurrently                      cap 90
# ep, rbd and overlap are the expert-parallel run, first so that a run stopped early has them; their caps add up to
# 580 s on 8 GPUs (--parts ep,rbd,overlap runs them alone). Each writes its files as it goes.
# Every part writes its json + md (date, GPU, commit, command) into OUT_DIR; multi_gpu_summary.{md,json} (parts'
# exit codes / times / commands, every comparison with the targets, the loss comparison, the predictions, the log
# tails of failed parts) is rewritten after each part. Full logs stay in a scratch folder, printed at the end.
set -u
cd "$(dirname "$0")/.."
# NVLink multicast (NVLS) off unless asked for: it needs fabric-manager support that not every host has
export PYTHONPATH=. NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
CPU=0; RESULTS=benchmarks/results/multi_gpu; NGPU=""; STEPS=""; PARTS=ep,rbd,overlap,table,ssmb,loss
ARGS="$*"; POSITIONAL=0
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) CPU=1; shift ;;
        --out) RESULTS=$2; shift 2 ;;
        --gpus) NGPU=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --parts) PARTS=$2; shift 2 ;;
        -*) echo "run_multi_gpu: unknown argument $1 (expected OUT_DIR [N], --cpu, --out DIR, --gpus N, --steps S," \
                 "--parts LIST)"; exit 2 ;;
        *) if [ $POSITIONAL = 0 ]; then RESULTS=$1; elif [[ $1 =~ ^[0-9]+$ ]]; then NGPU=$1
           else echo "run_multi_gpu: a second positional argument is a GPU count, got $1"; exit 2; fi
           POSITIONAL=$((POSITIONAL + 1)); shift ;;
    esac
done
for p in ${PARTS//,/ }; do
    case $p in ep|rbd|overlap|table|ssmb|loss) ;; *) echo "run_multi_gpu: unknown part $p in --parts"; exit 2 ;; esac
done
if ! git rev-parse HEAD > /dev/null 2>&1 && [ -z "${XMOE_COMMIT:-}" ]; then
    echo "run_multi_gpu: no git history here and XMOE_COMMIT unset: the results will name no commit" \
         "(XMOE_COMMIT=<hash> bash benchmarks/run_multi_gpu.sh ...)"
fi
mkdir -p "$RESULTS"
export XMOE_RESULTS_DIR=$RESULTS  # the benchmarks write their json + md files there (benchmarks/harness.py)
W=$(mktemp -d /tmp/xmoe-multi-gpu.XXXXXX)
T0=$(date +%s)

if [ $CPU = 1 ]; then
    NP=4; FLAG=--cpu; DEV="--device cpu"; STEPS=${STEPS:-40}
    EP_ARGS=""; EP_REDUCED=""; RBD_ARGS=""; OVERLAP_ARGS="--micro-batches 1 2"
    TABLE_ARGS="--micro-batches 1 2"; SSMB_ARGS="--micro-batches 1"
    CAP_EP=120; CAP_EP_REDUCED=120; CAP_RBD=120; CAP_OVERLAP=120; CAP_TABLE=120; CAP_SSMB=90; CAP_LOSS=120
    export OMP_NUM_THREADS=1
else
    NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    if [ "$NGPU" -ge 8 ]; then NP=8; elif [ "$NGPU" -ge 4 ]; then NP=4; elif [ "$NGPU" -ge 2 ]; then NP=2
    else echo "run_multi_gpu: needs >= 2 GPUs, found ${NGPU}"; exit 1; fi
    FLAG=""; DEV=""; STEPS=${STEPS:-300}
    EP_ARGS=""; EP_REDUCED="--tokens 16384"; RBD_ARGS="--tokens 8192"
    OVERLAP_ARGS="--case-budget-s 45 --micro-batches 1 2 4 8"
    TABLE_ARGS="--case-budget-s 33"; SSMB_ARGS="--case-budget-s 35 --micro-batches 1 2 4 8 16"
    CAP_EP=150; CAP_EP_REDUCED=80; CAP_RBD=90; CAP_OVERLAP=110; CAP_TABLE=235; CAP_SSMB=100; CAP_LOSS=90
fi
GPN=$((NP / 2))  # two virtual nodes for RBD
VISIBLE=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NP - 1)))}
TORCHRUN="torchrun --standalone --nproc-per-node $NP"
: > "$W/parts.tsv"

wanted() { [[ ",$PARTS," == *",$1,"* ]]; }

part() {  # part NAME CAP_S COMMAND...: run under timeout, log to $W/NAME.log, record exit code and time
    local name=$1 cap=$2 start rc
    shift 2
    start=$(date +%s)
    echo "[$(( start - T0 )) s] $name: $*"
    timeout --kill-after=15 "$cap" "$@" > "$W/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$cap" "$*" >> "$W/parts.tsv"
    return 0
}

summary() {  # rewrite multi_gpu_summary.{md,json} from what exists now
    python benchmarks/multi_gpu_summary.py "$RESULTS" "$W" --command "bash benchmarks/run_multi_gpu.sh $ARGS" \
        --world "$NP" --gpus-per-node "$GPN" $([ $CPU = 1 ] && echo --cpu) > "$W/summary.log" 2>&1
}

# plans: predictions (host only, in the background while the GPUs work)
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

# the expert-parallel run: the layer at each EP size (on the first P GPUs), RBD, the whole model's overlap
if wanted ep; then
    for P in 2 4 8; do
        [ $P -le $NP ] || continue
        if [ $P = 2 ] || [ $P = $NP ]; then EXTRA=$EP_ARGS; CAP=$CAP_EP; else EXTRA=$EP_REDUCED; CAP=$CAP_EP_REDUCED; fi
        part ep$P $CAP env CUDA_VISIBLE_DEVICES="$(echo "$VISIBLE" | cut -d, -f1-$P)" \
            torchrun --standalone --nproc-per-node $P benchmarks/bench_ep.py $FLAG $EXTRA
        summary
    done
fi
if wanted rbd; then
    part rbd $CAP_RBD $TORCHRUN benchmarks/bench_rbd.py --gpus-per-node $GPN --max-nodes-per-token 0 1 $FLAG $RBD_ARGS
    summary
fi
if wanted overlap; then
    part overlap $CAP_OVERLAP $TORCHRUN benchmarks/bench_train_multi_gpu.py --mode overlap $FLAG $OVERLAP_ARGS
    summary
fi

# the X-MoE paper's experiments
if wanted table; then
    part table $CAP_TABLE $TORCHRUN benchmarks/bench_train_multi_gpu.py $FLAG $TABLE_ARGS
    summary
fi
if wanted ssmb; then
    part ssmb $CAP_SSMB $TORCHRUN benchmarks/bench_train_multi_gpu.py --mode ssmb $FLAG $SSMB_ARGS
    summary
fi
if wanted loss; then
    # same tiny model, seed, data and global batch (16 sequences); EP=NP vs one process. Run together: only the
    # losses are compared, so sharing GPU 0 costs nothing that matters
    TRAIN="-m xmoe train --steps $STEPS --batch-size 16 --log-every 10 --ckpt-every 0 $DEV"
    part loss_single $CAP_LOSS env CUDA_VISIBLE_DEVICES="${VISIBLE%%,*}" python $TRAIN --out "$W/loss_single" &
    LS=$!
    part loss_ep $CAP_LOSS $TORCHRUN $TRAIN --ep $NP --out "$W/loss_ep"
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
fi
wait $PLANS
summary

echo
echo "===== multi-GPU benchmarks summary ($(( $(date +%s) - T0 )) s; full logs in $W) ====="
echo "| part | exit | seconds | cap | command |"
awk -F'\t' '{ printf "| %s | %s | %s | %s | `%s` |\n", $1, $2, $3, $4, $5 }' "$W/parts.tsv"
[ -f "$W/loss.md" ] && cat "$W/loss.md"
for f in train_multi_gpu_table train_multi_gpu_ssmb; do
    # the first table of the file: the largest micro-batch per (variant, method)
    [ -f "$RESULTS/$f.md" ] && awk '/^\| variant/ {on = 1} on && !/^\|/ {exit} on' "$RESULTS/$f.md"
done
# every comparison with the targets, as the summary gathered them
awk '/^## Against the targets/ {on = 1; next} /^## / {on = 0} on && NF' "$RESULTS/multi_gpu_summary.md"
[ -s "$W/summary.log" ] && { echo "summary: errors"; cat "$W/summary.log"; }
echo "files in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
