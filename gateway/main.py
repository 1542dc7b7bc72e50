"""``flying-gateway``: the OpenAI-style HTTP gateway process."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import uvicorn

from flying import settings
from gateway.app import create_app
from gateway.config import GatewayConfig


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    d = GatewayConfig(model_path="")
    p = argparse.ArgumentParser(
        prog="flying-gateway", description="OpenAI-style API over the flying-serving queue."
    )
    p.add_argument(
        "--model-path", required=True, help="model (or tokenizer) directory, for prompt token counts"
    )
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--redis-url", default=settings.redis_url())
    p.add_argument("--key-prefix", default=settings.key_prefix())
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    a = p.parse_args(argv)
    return dataclasses.replace(
        d,
        model_path=a.model_path,
        served_model_name=a.served_model_name,
        host=a.host,
        port=a.port,
        redis_url=a.redis_url,
        key_prefix=a.key_prefix,
        max_queue=a.max_queue,
        queue_timeout_s=a.queue_timeout_s,
        default_max_tokens=a.default_max_tokens,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
