# zerolab on GPUs: CUDA, Python 3.11, the pinned torch (CUDA build) + deepspeed, and zerolab.
#
#   docker build -t zerolab .
#   docker run --rm --gpus all --ipc=host -v "$PWD/runs:/opt/zerolab/runs" zerolab \
#       --standalone --nproc_per_node=gpu train.py strategy=zero2 precision=bf16
#
# The entrypoint is torchrun: arguments are torchrun's, then train.py and Hydra overrides.
# The pins below must equal pyproject.toml's (tests/test_docker.py checks them).
#
# A -devel image: DeepSpeed compiles its CUDA ops (FusedAdam) with nvcc on first use, for the GPU
# it sees. Its CUDA major version must match the one torch was built with; change CUDA_IMAGE
# together with the torch build if they differ. DeepSpeed's ops are built here as `make install`
# builds them (python -m zerolab.ds_ops build; tests/test_docker.py holds the two to one command):
# cpu_adam, the host's Adam that optimizer offload runs, is in the image; fused_adam is a CUDA op
# and builds on the first run (no GPU is visible to `docker build`).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# pyproject.toml requires Python 3.11; Ubuntu 22.04 ships it as python3.11 (universe).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev ninja-build g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv

# torch first: the default index's Linux wheel of torch is the CUDA build (it brings the CUDA
# runtime, cuDNN and NCCL as wheels). For a build against another CUDA version, add that build's
# --index-url to this line.
RUN pip install torch==2.13.0 setuptools wheel
# DeepSpeed ships as source and its build imports torch: build it against the torch above.
RUN pip install --no-build-isolation deepspeed==0.19.8

WORKDIR /opt/zerolab
COPY pyproject.toml README.md ./
COPY zerolab ./zerolab
RUN pip install --no-build-isolation .
# DeepSpeed's ops for its CUDA accelerator (DS_ACCELERATOR: no GPU is visible here to detect it),
# into /opt/venv/torch_extensions, where zerolab's DeepSpeed runs look. DeepSpeed compiles its CPU
# ops for the CPU that builds them (-march=native): build the image on the kind of node it runs on.
RUN DS_ACCELERATOR=cuda python -m zerolab.ds_ops build
COPY train.py ./
COPY conf ./conf
COPY launch ./launch

# Run as an unprivileged user; runs/ is where a volume goes. The user owns the ops directory: torch
# takes a lock file in an op's directory on every load, and fused_adam is built there on first use.
RUN useradd --create-home --uid 1000 zerolab && mkdir -p runs && chown zerolab:zerolab runs \
 && chown -R zerolab:zerolab /opt/venv/torch_extensions
USER zerolab

ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc_per_node=gpu", "train.py"]
