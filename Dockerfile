# ftq service image: the API, the worker and the trainer (one image, different commands).
#
# torch comes from PyPI: its Linux wheels carry their own CUDA runtime, so the base needs no
# CUDA toolkit; the NVIDIA container toolkit on the host provides the driver. Pick the torch
# that matches the box's driver with --build-arg TORCH_VERSION=...
FROM python:3.11-slim

ARG TORCH_VERSION=2.11.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FTQ_HOST=0.0.0.0 \
    FTQ_PORT=8000 \
    FTQ_DATA_DIR=/data \
    FTQ_MODEL_ROOT=/models \
    HF_HOME=/data/hf

RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY api ./api
COPY cli ./cli
COPY core ./core
COPY migrations ./migrations
COPY trainer ./trainer
COPY worker ./worker
# The qlora extra (bitsandbytes) lets a worker on a GPU take method: qlora; the API and
# workers without a GPU carry it unused (their detect reports no CUDA, so qlora stays refused).
RUN pip install ".[qlora]" \
    && useradd --create-home --uid 1000 ftq \
    && mkdir -p /data /models \
    && chown ftq:ftq /data

USER ftq
EXPOSE 8000
VOLUME ["/data"]
CMD ["ftq", "api"]
