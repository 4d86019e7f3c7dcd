# One image for every orchestrator service: worker, beat, flower, init.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY pglock_celery ./pglock_celery
COPY tasks ./tasks
COPY celeryconfig.py ./
RUN pip install --no-cache-dir -e '.[redis,binary,run]'
ENV PYTHONPATH=/app
USER nobody
