# The seckill example's image: the celery_redislock package and example_worker.
#   docker compose up --build --scale worker=4
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
COPY example_worker ./example_worker
RUN pip install . \
    && useradd --create-home --uid 10001 seckill

USER seckill
# The compose file sets the command of each service; this default runs a worker.
CMD ["python", "-m", "example_worker", "--worker"]
