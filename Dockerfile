# One image for the API and the workers (docker-compose.yml picks the command).
# TORCH_INDEX_URL: the CPU wheels by default (API, CPU worker); the GPU worker builds with
# https://download.pytorch.org/whl/cu128 (see docker-compose.yml).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# torchvision's release for that torch (its minor is torch's + 15): the `rewards` extra's
# open-clip-torch imports torchvision, which imports only beside the torch it was built for;
# left to pip it came from PyPI and replaced the torch above with PyPI's (see the Makefile)
ARG TORCHVISION_VERSION=0.28.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# the package's extras; the reward server's image adds `rewards` (open_clip), see
# docker-compose.yml; `tracking` lets jobs use report_to (TensorBoard, W&B, MLflow)
ARG EXTRAS=server,clip,tracking

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    DATA_DIR=/data

# a C compiler: on GPU workers triton (torch.compile, the `torch_compile` field the flux-lora
# preset turns on) builds its kernel launchers with one at run time
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 studio
WORKDIR /app

RUN case ",${EXTRAS}," in *,rewards,*) vision="torchvision==${TORCHVISION_VERSION}";; \
        *) vision="";; esac \
    && pip install "torch==${TORCH_VERSION}" $vision --index-url "${TORCH_INDEX_URL}"
# dependencies first (cached while only the code changes)
COPY pyproject.toml README.md ./
RUN mkdir -p app worker trainer && touch app/__init__.py worker/__init__.py trainer/__init__.py \
    && pip install ".[${EXTRAS}]" && pip uninstall -y neighbor-grpo-studio
COPY alembic.ini ./
COPY migrations ./migrations
COPY app ./app
COPY worker ./worker
COPY trainer ./trainer
# the code runs from /app (app/migrate.py finds alembic.ini and migrations/ beside it)
ENV PYTHONPATH=/app
RUN mkdir -p /data && chown studio:studio /data

USER studio
VOLUME ["/data"]
EXPOSE 8000
CMD ["uvicorn", "app.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000"]
