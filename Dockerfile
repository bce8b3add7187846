# The broker image: the API (`rollout-broker serve`), the workers (`rollout-broker worker`) and
# the migrations (`rollout-broker migrate`) all run from it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /srv/rollout-broker

COPY pyproject.toml README.md ./
COPY clients ./clients
COPY app ./app
COPY workers ./workers
COPY migrations ./migrations
# No [embedded] extra: the image talks to the Redis and Postgres it is given.
RUN pip install ./clients/python . && useradd --system --no-create-home broker

USER broker
EXPOSE 8000
CMD ["rollout-broker", "serve", "--host", "0.0.0.0", "--port", "8000"]
