# CUDA laptop path: the image the post used, plus what requirements.txt adds (its torch is kept).
#   docker build -t tiny-gpt-inference .
#   docker run --rm --gpus all tiny-gpt-inference                  # self-checks
#   docker run --rm --gpus all tiny-gpt-inference python -m pytest -q
#   docker run --rm --gpus all tiny-gpt-inference python bench.py cuda
# The serving engines (requirements-serve.txt) are not in the image; their tests skip here and say so.
FROM pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir --break-system-packages -r requirements.txt
COPY . .
# The self-checks, cached.py on the GPU when torch sees one.
CMD ["sh", "-c", "python model.py && python sampling.py && python cached.py --device \"$(python -c 'import torch; print(\"cuda\" if torch.cuda.is_available() else \"cpu\")')\""]
