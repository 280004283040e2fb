# The CUDA path: the image the post used, plus what requirements.txt adds (its torch is kept).
#   docker build -t tiny-gpt .                                   # the lesson
#   docker run --rm --gpus all tiny-gpt                          # its self-checks, cached.py on the GPU
#   docker run --rm --gpus all tiny-gpt python prefill_clone.py --device cuda
#   docker run --rm --gpus all tiny-gpt python bench.py cuda
# Serving: the second stage adds engines/requirements.txt (llama-cpp-python compiles llama.cpp: 15 minutes or more).
#   docker build --target serve -t tiny-gpt-serve .
#   docker run --rm --gpus all -p 8000:8000 tiny-gpt-serve python -m engines.serve --host 0.0.0.0 --device cuda --api-key KEY
#   docker run --rm --gpus all tiny-gpt-serve                    # every CUDA claim: engines/fast/gpu_check.sh
FROM pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime AS base

# torch.compile's inductor builds its CPU kernels (and the compiled step's C++ wrapper) with g++,
# which the -runtime image does not ship (gcc, which Triton builds with on CUDA, comes with it);
# without it --compile on the CPU refuses.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt ./
COPY engines/requirements.txt engines/
RUN pip install --no-cache-dir --break-system-packages -r requirements.txt

FROM base AS serve
RUN pip install --no-cache-dir --break-system-packages -r engines/requirements.txt
# what .dockerignore lets in: the repo's own files, no corpus, venv or leftovers
COPY . .
# in a container the server listens beyond loopback (--host 0.0.0.0), where engines/serve.py asks for --api-key or --allow-host
EXPOSE 8000
CMD ["bash", "engines/fast/gpu_check.sh"]

FROM base AS lesson
COPY . .
# The self-checks, cached.py on the GPU when torch sees one.
CMD ["sh", "-c", "python model.py && python sampling.py && python cached.py --device \"$(python -c 'import torch; print(\"cuda\" if torch.cuda.is_available() else \"cpu\")')\""]
