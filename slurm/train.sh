#!/bin/bash
# Train one SAE config with DDP over every task of a SLURM job (one task per GPU, any number of nodes).
#
#   mkdir -p slurm-logs                                   # SLURM does not create the log directory
#   sbatch slurm/train.sh configs/mpsae_dinov2.yaml       # 1 node x 4 GPUs (#SBATCH lines below)
#   sbatch --nodes=4 slurm/train.sh configs/mpsae_dinov2.yaml            # 16 GPUs
#   sbatch slurm/train.sh configs/topk_dinov2.yaml --model.sae.init_args.k 64   # extra flags pass through
#   sbatch slurm/train.sh configs/mpsae_dinov2.yaml --ckpt_path last     # continue the config's newest run
#
# `srun` starts one `python -m sae_pipeline fit` per task; Lightning's SLURMEnvironment reads the
# ranks from SLURM and sets up DDP (NCCL on GPUs, gloo on CPUs). This script passes
# `--trainer.num_nodes` and `--trainer.devices` from the allocation (flags you add come later and win).
#
# Outputs (run name = config file stem; version = slurm-<job id>, or slurm-<array job>_<task>):
#   runs/<name>/slurm-<id>/          TensorBoard events, config.yaml, hpc_ckpt_<n>.ckpt after a pre-emption
#   runs/<name>/slurm-<id>/checkpoints/   last.ckpt (final state) and the periodic ones (`--checkpoint.*`)
#   slurm-logs/<job name>-<id>.out   this log: progress bar, errors (SLURM appends after a requeue)
#
# Pre-emption and time limit: SLURM sends SIGUSR1 90 s before it stops the job (--signal below).
# At the next training step every rank agrees on it, Lightning's hpc checkpoint is saved as
# runs/<name>/slurm-<id>/hpc_ckpt_<n>.ckpt and the job requeues itself (`scontrol requeue`, same job
# id). The requeued job runs this script again; Lightning finds the hpc checkpoint in that same
# directory and resumes from it (global step, optimiser, schedule, dead-latent statistics, position
# in the data stream), logging into the same TensorBoard run. Test it with `scancel --signal=USR1 <id>`.
#
# Environment (defaults in brackets):
#   PYTHON       interpreter with this package installed [python]
#   SRUN_ARGS    extra flags for srun, e.g. "--cpu-bind=none" [none]
# sbatch options on its command line (--nodes=2, --time=4:00:00, ...) and sbatch's own variables
# (SBATCH_PARTITION, SBATCH_TIMELIMIT, SBATCH_GRES: "none" on a CPU partition, ...) override the
# lines below.
#
# Edit these for your cluster (keep --ntasks-per-node equal to the GPUs per node):
#SBATCH --job-name=train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=24:00:00
#SBATCH --signal=SIGUSR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-logs/%x-%j.out

set -uo pipefail

usage="usage: sbatch slurm/train.sh CONFIG.yaml [flags], e.g. sbatch slurm/train.sh configs/mpsae_dinov2.yaml"
if [[ $# -lt 1 || -z "${1:-}" ]]; then
    echo "error: missing config file; $usage" >&2
    exit 2
fi
CONFIG=$1
shift
if [[ ! -f "$CONFIG" ]]; then
    echo "error: config file '$CONFIG' not found (relative paths start at $PWD); $usage" >&2
    exit 2
fi

PYTHON=${PYTHON:-python}
read -r -a SRUN_EXTRA <<< "${SRUN_ARGS:-}"
NUM_NODES=${SLURM_JOB_NUM_NODES:-1}
NTASKS=${SLURM_NTASKS:-1}
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-$(( NTASKS / NUM_NODES ))}

echo "train: config=$CONFIG job=${SLURM_JOB_ID:-none} restart=${SLURM_RESTART_COUNT:-0}" \
     "nodes=$NUM_NODES tasks/node=$TASKS_PER_NODE host=$(hostname)" >&2

# --kill-on-bad-exit: a rank that fails stops the others at once instead of leaving them in a collective.
exec srun --kill-on-bad-exit=1 "${SRUN_EXTRA[@]}" \
    "$PYTHON" -m sae_pipeline fit --config "$CONFIG" \
    --trainer.num_nodes "$NUM_NODES" --trainer.devices "$TASKS_PER_NODE" \
    "$@"
