# The CUDA path: the image the post used, plus what requirements.txt adds (its torch is kept); the second stage
# adds engines/requirements.txt (llama-cpp-python compiles llama.cpp: 15 minutes or more on 2 cores).
# The build and run lines: the README's "On a CUDA GPU, through Docker"; .ci/docker builds both stages on a CPU,
# on a stand-in of this base, and runs those lines in them.
FROM pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime AS base

# torch.compile's inductor builds its CPU kernels (and the compiled step's C++ wrapper) with g++,
# which the -runtime image does not ship (gcc, which Triton builds with on CUDA, comes with it);
# without it --compile on the CPU refuses.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt ./
COPY engines/requirements.txt engines/
# pip's cache is a cache mount, kept out of the image; a rebuild reuses its wheels (llama.cpp's above all)
RUN --mount=type=cache,target=/root/.cache/pip pip install --break-system-packages -r requirements.txt

FROM base AS serve
RUN --mount=type=cache,target=/root/.cache/pip pip install --break-system-packages -r engines/requirements.txt
# what .dockerignore lets in: the repo's own files, no corpus, venv or leftovers
COPY . .
# in a container the server listens beyond loopback (--host 0.0.0.0), where python -m engines.serve needs a key
# ($TINY_GPT_API_KEY passed in by -e, or --api-key-file): README, "On a CUDA GPU, through Docker"
EXPOSE 8000
CMD ["bash", "engines/fast/gpu_check.sh"]

FROM base AS lesson
COPY . .
# The self-checks, cached.py on the GPU when torch sees one.
CMD ["sh", "-c", "python model.py && python sampling.py && python cached.py --device \"$(python -c 'import torch; print(\"cuda\" if torch.cuda.is_available() else \"cpu\")')\""]
