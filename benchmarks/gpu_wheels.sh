#!/usr/bin/env bash
# Wheels for the lent GPU machine (docs/where-to-run.md): the peers of benchmarks/peers.py and what the product
# needs beside that machine's image, for its Python 3.12 on x86-64 Linux, into .whl/ (git-ignored).
#
#     bash benchmarks/gpu_wheels.sh          # or: make gpu-wheels
#
# That machine reaches no registry, so what its image lacks travels with the call (carry .whl); python -m
# benchmarks.gpu_suite installs these into a folder of its own before its parts run. Only what the image lacks
# is listed (its package list: the device tool's page of machine kinds; it has torch 2.11, lightning 2.6.6, timm,
# transformers, huggingface-hub, h5py, tensorboard, xxhash, ...), each with --no-deps, so no second torch or
# numpy shadows the image's. Versions are the ones the test suite passes with here. Dependencies that
# no import reaches (plotly, nltk, babe: sae-lens's runners; opencv-python: the image has the headless
# cv2; nnsight, umap-learn, circuitsvis: dictionary-learning's, whose trainers benchmarks/peers.py imports
# with a stub for nnsight, benchmarks/peer_dictionary_learning.py) stay behind, which keeps the carried set
# small: about 30 MiB (20 of them wandb, which sae-lens imports), against the 64 MiB the device tool carries.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-python3}

PRODUCT=(   # pyproject's dependencies missing from the image
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 importlib-resources==7.1.0
    webdataset==1.0.2 braceexpand==0.1.7
    open-clip-torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4
    typing-extensions==4.16.0   # pydantic 2.14 needs >= 4.16; newer is backward compatible
)
PEERS=(     # the bench extra and what importing it reaches
    sae-lens==6.54.12 eai-sparsify==1.3.3 overcomplete==0.3.0 dictionary-learning==0.1.0
    transformer-lens==3.9.0 datasets==5.2.0 simple-parsing==0.1.9 schedulefree==1.4.1 natsort==8.4.0
    better-abc==0.0.3 dill==0.4.1 multiprocess==0.70.19 platformdirs==4.14.8 sniffio==1.3.1
    tenacity==9.2.1 python-dotenv==1.2.4
    wandb==0.31.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-exporter-http-transport==0.66b2 googleapis-common-protos==1.76.0
)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl   # one version of each: two stop the install there
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${PRODUCT[@]}" "${PEERS[@]}"
if ! git check-ignore -q "$DEST/x.whl"; then
    echo "warning: $DEST is not git-ignored: it would travel twice (as the tree and as carry)" >&2
fi
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST; carry it: run(carry=[\"$DEST\"], ...)"
