# One image for every Orka service; the command picks which (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY . /src
RUN pip install . && rm -rf /src/build

WORKDIR /
ENTRYPOINT ["orka"]
CMD ["--help"]
