# CUDA laptop path: the image the post used, plus what it lacks (regex).
#   docker build -t tiny-gpt-inference .
#   docker run --rm --gpus all tiny-gpt-inference                  # self-checks
#   docker run --rm --gpus all tiny-gpt-inference python bench.py cuda
FROM pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime

WORKDIR /app
RUN pip install --no-cache-dir --break-system-packages regex==2026.9.29 numpy==2.4.6 pytest==9.0.3
COPY . .
# The self-checks, cached.py on the GPU when torch sees one.
CMD ["sh", "-c", "python model.py && python sampling.py && python cached.py --device \"$(python -c 'import torch; print(\"cuda\" if torch.cuda.is_available() else \"cpu\")')\""]
