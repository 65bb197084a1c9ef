# sae-pipeline for cloud GPUs: extraction and training in one image.
#
#   docker build -t sae-pipeline .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.7.1-cuda11.8-cudnn9-runtime -t sae-pipeline .
#   docker run --gpus all --shm-size=16g -v /big/disk:/data -v "$PWD/runs:/runs" sae-pipeline \
#       fit --config configs/mpsae_dinov2.yaml
#   docker run --gpus all --shm-size=16g -v /big/disk:/data sae-pipeline \
#       extract --config configs/extract_dinov2.yaml --images /data/imagenet/train
#
# Without a Docker daemon or a registry (as CI does it, tests/test_docker.py): build a stand-in base
# with `python docker/standin_base.py --tag localhost/pytorch-standin:latest`, then
#   buildah bud --isolation chroot --network host --format docker \
#       --build-arg BASE_IMAGE=localhost/pytorch-standin:latest -t sae-pipeline .
#
# Working directory /app holds configs/ and slurm/; /app/shards points to /data/shards (where the
# configs read and extraction writes shards) and /app/runs to /runs (TensorBoard logs, checkpoints).
# No credentials are baked in: pass tokens at run time (-e HF_TOKEN) if a backbone download needs one.

# Any CUDA PyTorch image works; its torch (and torchvision) are kept, and must satisfy pyproject.toml.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY feature_extraction/ feature_extraction/
COPY sae_pipeline/ sae_pipeline/
# Install the package and the dependencies pyproject.toml lists, with the `s3` extra (s3fs) so the
# image reads and writes shards in a bucket. The constraint file holds the base image's own
# torch / torchvision, so pip keeps its CUDA build instead of fetching another one.
RUN python -m pip list --format=freeze | { grep -iE '^(torch|torchvision)==' || true; } > /tmp/base-image.txt \
    && python -m pip install --no-cache-dir --constraint /tmp/base-image.txt .[s3] \
    && rm /tmp/base-image.txt
COPY configs/ configs/
COPY slurm/ slurm/

RUN useradd --create-home --no-log-init --uid 1000 sae \
    && mkdir -p /data/shards /runs \
    && ln -s /data/shards /app/shards \
    && ln -s /runs /app/runs \
    && chown -R sae:sae /data /runs
USER 1000:1000
VOLUME ["/data", "/runs"]

# `fit`, `validate`, `test`, `predict`, `export`, and `extract` (python -m feature_extraction).
ENTRYPOINT ["python", "-m", "sae_pipeline"]
CMD ["--help"]
