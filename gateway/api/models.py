"""``GET /v1/models`` and ``/v1/models/{id}``: the served model's card."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.errors import ModelNotFound

if TYPE_CHECKING:
    from gateway.service import Gateway


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"object": "list", "data": [await model_card(gw)]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model's card, 404 (OpenAI's shape) for any other id."""
    gw: Gateway = request.app.state.gateway
    name = request.path_params["model_id"]
    if name != gw.config.served_model_name:
        raise ModelNotFound(
            f"The model '{name}' does not exist; this gateway serves '{gw.config.served_model_name}'",
            param="model",
        )
    return JSONResponse(await model_card(gw))


async def model_card(gw: Gateway) -> dict:
    """The served model, with its context length (``max_model_len``) once an engine reports it."""
    beats = await gw.cluster.workers()
    card: dict[str, object] = {
        "id": gw.config.served_model_name,
        "object": "model",
        "created": int(gw.started),
        "owned_by": "flying-serving",
    }
    if beats:
        card["max_model_len"] = gw.cluster.context_limit(beats)
    return card
