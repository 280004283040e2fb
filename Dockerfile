# CUDA laptop path: the image the post used, plus what requirements.txt adds (its torch is kept).
#   docker build -t tiny-gpt-inference .
#   docker run --rm --gpus all tiny-gpt-inference                  # self-checks
#   docker run --rm --gpus all tiny-gpt-inference python -m pytest -q
#   docker run --rm --gpus all tiny-gpt-inference python bench.py cuda --all
# The serving engines (requirements-serve.txt) are not in the image; their tests skip here and say so.
FROM pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime

# torch.compile's inductor builds its CPU kernels (and the compiled step's C++ wrapper) with g++,
# which the -runtime image does not ship (gcc, which Triton builds with on CUDA, comes with it);
# without it the compile tests skip and --compile refuses.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir --break-system-packages -r requirements.txt
# what .dockerignore lets in: the repo's own files, no corpus, venv or leftovers
COPY . .
# The self-checks, cached.py on the GPU when torch sees one.
CMD ["sh", "-c", "python model.py && python sampling.py && python cached.py --device \"$(python -c 'import torch; print(\"cuda\" if torch.cuda.is_available() else \"cpu\")')\""]
