# One image for every kvmesh service (router, frontend, worker); the command picks the role.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    KVMESH_CACHE_DIR=/opt/kvmesh-cache

RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
    && pip install -r requirements.txt \
    && pip uninstall -y torchvision torchaudio torchcodec || true \
    && pip install --no-deps -r requirements-nodeps.txt
COPY . .
RUN pip install --no-deps --no-build-isolation -e . \
    && python -m workers.model.prepare --no-progress

EXPOSE 8000 50051
CMD ["kvmesh", "--help"]
