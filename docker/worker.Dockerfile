# A GPU worker: the `tula` package with its `worker` extra (CUDA torch, torchvision, NVML) and Ray.
# It joins the Ray cluster and runs the profiling points the server's Ray executor sends it.
# Build from the repository root: docker build -f docker/worker.Dockerfile .
#
# CUDA comes from the torch wheel (PyPI's Linux x86_64 torch wheels are CUDA builds that carry the
# CUDA runtime, cuDNN and NCCL as nvidia-* wheels); the host's NVIDIA driver is mounted at run time
# by the NVIDIA Container Toolkit (compose: deploy.resources.reservations.devices). A python base
# rather than nvidia/cuda or pytorch/pytorch keeps the Python version equal to the server's, as Ray
# requires of every node and driver of a cluster.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /opt/tula
COPY pyproject.toml README.md constraints.txt ./
COPY tula_service ./tula_service
COPY profiler ./profiler
COPY models ./models
# constraints.txt pins torch and torchvision to the versions the test suite runs.
RUN pip install -c constraints.txt '.[worker,ray]'

RUN useradd --create-home --uid 10001 tula
USER tula
ENV RAY_HEAD_ADDRESS=ray-head:6379
# Ray finds the GPUs the container was given (NVML); --block keeps the container in the foreground.
CMD ["sh", "-c", "exec ray start --address=\"$RAY_HEAD_ADDRESS\" --block"]
