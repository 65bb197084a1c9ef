#!/bin/bash
# Train several configs as one SLURM array job: task i trains config i with slurm/train.sh
# (DDP over the task's GPUs, pre-emption requeue), each into its own TensorBoard run.
#
#   mkdir -p slurm-logs
#   bash slurm/sweep.sh configs/{relu,jumprelu,topk,batchtopk,mpsae}_dinov2.yaml   # submits --array=0-4
#   bash slurm/sweep.sh configs/sweep_k_dinov2.txt                                        # one task per line
#   bash slurm/sweep.sh configs/*_dinov2.yaml -- --trainer.max_epochs 10           # flags for every task
#   sbatch --array=0-4 slurm/sweep.sh configs/*_dinov2.yaml                        # the same, by hand
#
# Run with `bash`, the script submits itself with --array sized to the list; under sbatch, task
# $SLURM_ARRAY_TASK_ID picks its entry. Entries are config files, or one list file (*.txt): one
# entry per line, a config and optional flags for that task, `#` comments and blank lines
# skipped, e.g. for a Pareto curve over k:
#     configs/topk_dinov2.yaml --model.sae.init_args.k 16
#     configs/topk_dinov2.yaml --model.sae.init_args.k 64
# Run name: the config stem, plus the flags' last name parts and values when the entry has
# flags (runs/topk_dinov2-k16/, runs/topk_dinov2-k64/); version slurm-<array job>_<task>.
# An entry's own --trainer.logger.init_args.name wins.
#
# Environment (defaults in brackets): TRAIN_SCRIPT, the per-task training script
# [slurm/train.sh beside this one when run with bash; slurm/train.sh under the submission
# directory under sbatch]; PYTHON and SRUN_ARGS as in slurm/train.sh.
#
# Resources per task (edit for your cluster; as slurm/train.sh):
#SBATCH --job-name=sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=24:00:00
#SBATCH --signal=SIGUSR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-logs/%x-%A_%a.out

set -uo pipefail

usage="usage: bash slurm/sweep.sh CONFIG.yaml... | LIST.txt [-- FLAGS for every task]"
ENTRIES=()
COMMON=()
while [[ $# -gt 0 ]]; do
    if [[ $1 == "--" ]]; then
        shift
        COMMON=("$@")
        break
    fi
    ENTRIES+=("$1")
    shift
done
if [[ ${#ENTRIES[@]} -eq 0 ]]; then
    echo "error: no configs given; $usage" >&2
    exit 2
fi

LINES=()
if [[ ${#ENTRIES[@]} -eq 1 && ${ENTRIES[0]} == *.txt ]]; then
    if [[ ! -f ${ENTRIES[0]} ]]; then
        echo "error: sweep list '${ENTRIES[0]}' not found (relative paths start at $PWD); $usage" >&2
        exit 2
    fi
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        [[ -z ${line//[[:space:]]/} ]] || LINES+=("$line")
    done < "${ENTRIES[0]}"
else
    LINES=("${ENTRIES[@]}")
fi
if [[ ${#LINES[@]} -eq 0 ]]; then
    echo "error: sweep list '${ENTRIES[0]}' has no entries; $usage" >&2
    exit 2
fi

if [[ -z ${SLURM_JOB_ID:-} ]]; then  # not in a job: submit this script as the array job
    export TRAIN_SCRIPT=${TRAIN_SCRIPT:-$(cd "$(dirname "$0")" && pwd)/train.sh}
    exec sbatch --array="0-$(( ${#LINES[@]} - 1 ))" "$0" "${ENTRIES[@]}" ${COMMON[@]+-- "${COMMON[@]}"}
fi
if [[ -z ${SLURM_ARRAY_TASK_ID:-} ]]; then
    echo "error: not an array job; submit with sbatch --array=0-$(( ${#LINES[@]} - 1 )) or run: bash slurm/sweep.sh ..." >&2
    exit 2
fi
if (( SLURM_ARRAY_TASK_ID >= ${#LINES[@]} )); then
    echo "error: array task $SLURM_ARRAY_TASK_ID but only ${#LINES[@]} entries; use --array=0-$(( ${#LINES[@]} - 1 ))" >&2
    exit 2
fi

read -r -a TASK <<< "${LINES[$SLURM_ARRAY_TASK_ID]}"
CONFIG=${TASK[0]}
FLAGS=("${TASK[@]:1}")
NAME=$(basename "$CONFIG")
NAME=${NAME%.*}
SUFFIX=""
for word in "${FLAGS[@]}"; do  # --model.sae.init_args.k 64 -> k64; --model.lr=1e-3 -> lr1e-3
    if [[ $word == --* ]]; then
        word=${word#--}
        key=${word%%=*}
        SUFFIX+="${SUFFIX:+_}${key##*.}"
        [[ $word == *=* ]] && SUFFIX+="${word#*=}"
    else
        SUFFIX+="$word"
    fi
done
SUFFIX=${SUFFIX//[^A-Za-z0-9._=+-]/}
NAME+=${SUFFIX:+-$SUFFIX}

TRAIN_SCRIPT=${TRAIN_SCRIPT:-slurm/train.sh}
echo "sweep: task $SLURM_ARRAY_TASK_ID/${#LINES[@]} run=$NAME entry: ${LINES[$SLURM_ARRAY_TASK_ID]}" >&2
exec bash "$TRAIN_SCRIPT" "$CONFIG" --trainer.logger.init_args.name "$NAME" "${FLAGS[@]}" "${COMMON[@]}"
