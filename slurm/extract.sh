#!/bin/bash
# Extract one backbone's tokens of an image set into webdataset shards, as a SLURM array job.
#
#   mkdir -p slurm-logs                      # SLURM does not create the log directory
#   sbatch slurm/extract.sh dinov2           # 8 tasks (#SBATCH --array below), 1 GPU each
#   IMAGES=/data/imagenet/train SHARDS_ROOT=/scratch/shards sbatch slurm/extract.sh siglip
#   SBATCH_ARRAY_INX=0-31 sbatch slurm/extract.sh clip          # 32 tasks instead of 8
#   EXTRACT_ARGS="--layer 6 --batch_size 128" sbatch slurm/extract.sh vit
#   EXTRACT_ARGS="--tokens_per_image 64" sbatch slurm/extract.sh dinov2   # 64 seeded patches + prefix per image
#   SBATCH_GRES=none PRETRAINED=false sbatch slurm/extract.sh vit_tiny   # no GPU, random weights
#
# Each array task writes the shards it owns (shard i belongs to task i % N); the task that
# finishes last writes $SHARDS_ROOT/<backbone>/manifest.json. If tasks died (time limit,
# preemption), resubmit the same command with the same array size: complete shards are
# skipped, partial ones redone. `python -m feature_extraction finalize --out
# $SHARDS_ROOT/<backbone>` writes the manifest by hand once every shard exists.
#
# Environment (defaults in brackets):
#   IMAGES        image folder, directory of image tars, or "samples" [$HOME/data/imagenet/train]
#   SHARDS_ROOT   output root; shards go to $SHARDS_ROOT/<backbone> [./shards]
#   PRETRAINED    true: the library's pretrained weights; false: random (seeded) weights [true]
#   PYTHON        interpreter with this package installed [python]
#   EXTRACT_ARGS  extra flags for `python -m feature_extraction` (see --help) [none]
#   NUM_WORKERS   image-decoding workers [$SLURM_CPUS_PER_TASK, else 8]
# sbatch itself reads SBATCH_ARRAY_INX (--array), SBATCH_GRES (--gres), SBATCH_PARTITION,
# SBATCH_TIMELIMIT, ...; those and command-line options override the lines below.
#
# Edit these for your cluster:
#SBATCH --job-name=extract
#SBATCH --array=0-7
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=12:00:00
#SBATCH --output=slurm-logs/%x-%A_%a.out

set -euo pipefail

if [[ $# -lt 1 || -z "${1:-}" ]]; then
    echo "error: missing backbone name; usage: sbatch slurm/extract.sh BACKBONE [flags], e.g. dinov2, siglip, clip or vit" >&2
    exit 2
fi
BACKBONE=$1
shift

IMAGES=${IMAGES:-$HOME/data/imagenet/train}
SHARDS_ROOT=${SHARDS_ROOT:-./shards}
PYTHON=${PYTHON:-python}
NUM_WORKERS=${NUM_WORKERS:-${SLURM_CPUS_PER_TASK:-8}}
PRETRAINED=${PRETRAINED:-true}
read -r -a EXTRA <<< "${EXTRACT_ARGS:-}"

echo "extract: backbone=$BACKBONE images=$IMAGES out=$SHARDS_ROOT/$BACKBONE" \
     "task=${SLURM_ARRAY_TASK_ID:-none}/${SLURM_ARRAY_TASK_COUNT:-1} host=$(hostname)" >&2

# task_index / num_tasks come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT.
exec "$PYTHON" -m feature_extraction \
    --backbone "$BACKBONE" \
    --images "$IMAGES" \
    --out "$SHARDS_ROOT/$BACKBONE" \
    --pretrained "$PRETRAINED" \
    --num_workers "$NUM_WORKERS" \
    "${EXTRA[@]}" "$@"
