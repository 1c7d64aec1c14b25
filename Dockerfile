# Skyring node image: `docker build -t skyring .` then `docker run -p 8080:8080 skyring`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/skyring
COPY pyproject.toml README.md ./
COPY skyring ./skyring
RUN pip install . \
    && useradd --system --uid 1000 --home-dir /var/lib/skyring skyring \
    && mkdir -p /var/lib/skyring \
    && chown skyring:skyring /var/lib/skyring

USER skyring
ENV SKYRING_HOST=0.0.0.0 \
    SKYRING_PORT=8080 \
    SKYRING_PEER_PORT=9090 \
    SKYRING_DATA_DIR=/var/lib/skyring
VOLUME ["/var/lib/skyring"]
EXPOSE 8080 9090

HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ping' % os.environ.get('SKYRING_PORT', '8080'), timeout=2)"]

ENTRYPOINT ["skyring"]
CMD ["serve"]
