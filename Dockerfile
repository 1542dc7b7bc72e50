# GPU image: stock sglang (CUDA torch) plus this project. Build on a GPU host: docker compose build
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "sglang==0.5.23" && pip install --no-cache-dir -e .
