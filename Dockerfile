# runpod-vlm: a RunPod serverless worker serving one vision-language model.
#
#   docker build -t runpod-vlm .                                              # weights fetched at boot
#   docker build -t runpod-vlm:qwen2-vl-2b --build-arg MODEL=Qwen/Qwen2-VL-2B-Instruct .  # weights baked in
#
# The base image provides CUDA, Python and torch + torchvision (transformers 5.17 needs torch >= 2.5
# and torchvision for the Qwen2-VL processors); requirements.txt deliberately leaves them out.
# torch 2.11 (torchvision 0.26, Triton 3.6) is the release the GPU benchmark measures (README
# "Performance", "Cold start"); its CUDA 12.8 build runs on hosts whose driver has CUDA 12.8 or
# newer (hub.json's allowedCudaVersions). The benchmark machine has the CUDA 13.0 build of the same
# release: --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime gives exactly that
# (CUDA 13.0 drivers only). Compiled artifacts are keyed by the full torch version string.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# HF_HOME: the Hugging Face cache lives in the image, at a path a RunPod network volume (mounted
# at /runpod-volume) can never shadow. Compile caches need no setting here: the worker keeps
# inductor's and Triton's under $HF_HOME/compile-cache and the compile-artifact file on the network
# volume when one is mounted (VLM_COMPILE_CACHE_DIR overrides; README "Cold start").
# RUNPOD_LOG_LEVEL: the SDK's default, DEBUG, logs every job's full answer; an endpoint's env can
# still set DEBUG to diagnose.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/opt/hf \
    HF_HUB_DISABLE_TELEMETRY=1 \
    RUNPOD_LOG_LEVEL=INFO

# torch.compile (VLM_COMPILE, on by default) has Triton build a small launcher with a C compiler at
# run time; the runtime base image has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Dependencies first (a layer that changes rarely). The constraints file pins the base image's own
# torch/torchvision so that no requirement can replace them with another build.
COPY requirements.txt /app/requirements.txt
RUN python -c "import importlib.metadata as m; print(f'torch=={m.version(\"torch\")}\ntorchvision=={m.version(\"torchvision\")}')" > /tmp/torch-constraints.txt \
    && pip install -c /tmp/torch-constraints.txt -r /app/requirements.txt \
    && rm /tmp/torch-constraints.txt

# Optional: another transformers release. The remote-code families (MiniCPM-V-2_6, Phi-3-vision,
# InternVL2) need 4.45-4.48 (e.g. --build-arg TRANSFORMERS_VERSION=4.48.3) and the packages their code
# imports (requirements-legacy.txt); an image built so serves only them (the native fast path needs
# 5.x). Checked on tiny models with the repositories' code, not on real weights: see README.
ARG TRANSFORMERS_VERSION=""
COPY requirements-legacy.txt /app/requirements-legacy.txt
RUN if [ -n "$TRANSFORMERS_VERSION" ]; then \
        pip install -r /app/requirements-legacy.txt "transformers==${TRANSFORMERS_VERSION}"; fi

# Optional: bake one model's weights into the image (e.g. --build-arg MODEL=Qwen/Qwen2-VL-2B-Instruct).
# Empty (the default) bakes nothing; the worker then downloads VLM_MODEL at its first boot.
# The baked model also becomes the image's default VLM_MODEL (an endpoint's env still overrides it).
ARG MODEL=""
ARG MODEL_REVISION=""
COPY scripts/bake_model.py /app/scripts/bake_model.py
RUN if [ -n "$MODEL" ]; then python /app/scripts/bake_model.py "$MODEL" $MODEL_REVISION; fi
ENV VLM_MODEL=${MODEL}

# The worker itself last: editing it rebuilds only this layer. handler.py is the entry, runpod_vlm/ its parts
# (test_handler.py checks that every module handler.py reaches is copied here).
COPY handler.py /app/handler.py
COPY runpod_vlm /app/runpod_vlm

CMD ["python", "-u", "handler.py"]
