# The API server: tula_service with PostgreSQL (psycopg 3, a core dependency) and Ray (to drive the
# GPU workers with --executor ray), without torch: the `worker` extra is not installed.
# Build from the repository root: docker build -f docker/server.Dockerfile .
# The Ray head runs this image too. Ray wants one Python and one Ray version on the whole cluster,
# so this image and worker.Dockerfile take the same PYTHON_VERSION and install Ray the same way.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/tula
COPY pyproject.toml README.md ./
COPY tula_service ./tula_service
COPY profiler ./profiler
COPY models ./models
RUN pip install '.[ray]'
COPY configs ./configs

RUN useradd --create-home --uid 10001 tula
USER tula
EXPOSE 8000
# --host 0.0.0.0 needs an API token in the database or --insecure: docker/compose.yaml says which.
CMD ["tula", "serve", "--host", "0.0.0.0", "--port", "8000"]
