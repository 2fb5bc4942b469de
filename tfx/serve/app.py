"""The OpenAI-compatible HTTP app (FastAPI): `/v1/completions`, `/v1/chat/completions`,
`/v1/models` and `/health` over one `EngineWorker`.

FastAPI because it is the stack the peers use (vLLM, SGLang, `transformers serve`): pydantic
bodies give the request checks, Starlette streams server-sent events, and uvicorn serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from tfx.generation import Engine
from tfx.serve.choices import Choices
from tfx.serve.loading import Served
from tfx.serve.protocol import ChatRequest, CompletionRequest, OpenAIError, error_body
from tfx.serve.responses import Response
from tfx.serve.worker import EngineWorker

__all__ = ["create_app"]


def create_app(served: Served, *, num_pages: int, page_size: int = 16, max_batch: int = 16,
               chunk: int = 64, prefix_cache: bool = True) -> FastAPI:
    """The app serving `served` with a paged engine (arguments as `tfx.generation.Engine`'s;
    prompt prefixes are cached by default). The engine's thread starts with the app's lifespan
    and stops with it, failing what is still unfinished."""
    engine = Engine(served.model, num_pages=num_pages, page_size=page_size,
                    max_batch=max_batch, chunk=chunk, variants=len(served.adapters) + 1,
                    prefix_cache=prefix_cache)
    worker = EngineWorker(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="tfx serve", lifespan=lifespan)
    app.state.worker, app.state.served = worker, served
    _errors(app)
    app.include_router(ROUTES)
    return app


# The routes read the served model and the worker from the app they belong to.
ROUTES = APIRouter()


@ROUTES.get("/health")
async def health(request: Request) -> dict:
    free, pending, pages = await request.app.state.worker.call(
        lambda e: (e.num_free_pages, e.num_pending, e.allocator.num_pages))
    return {"status": "ok", "pages": pages, "free_pages": free, "requests": pending}


@ROUTES.get("/v1/models")
async def models(request: Request) -> dict:
    served, made = request.app.state.served, int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": made, "owned_by": "tfx",
         **({"parent": served.name} if name != served.name else {})}
        for name in (served.name, *served.adapters)]}


@ROUTES.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    served = request.app.state.served
    prompt = (np.asarray(body.prompt, np.int64) if isinstance(body.prompt, list)
              else np.asarray(served.tokenizer.encode(body.prompt)))
    choices = Choices(request.app.state.worker, served.tokenizer, body, prompt,
                      max_tokens=body.max_tokens, eos=served.eos,
                      variant=_variant(served, body.model))
    return await _answer(choices, body, request, chat=False, logprobs=body.logprobs is not None)


@ROUTES.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    served = request.app.state.served
    tokenizer = served.tokenizer
    if not hasattr(tokenizer, "encode_chat"):
        raise OpenAIError(400, f"model {served.name!r} has no chat template (serve a Hugging "
                          "Face folder, or a run started from one)", param="messages")
    try:
        prompt, _ = tokenizer.encode_chat([m.text() for m in body.messages],
                                          add_generation_prompt=True)
    except ValueError as error:
        raise OpenAIError(400, str(error), param="messages") from None
    eos = tuple(dict.fromkeys((*([tokenizer.eos_id] if tokenizer.eos_id is not None else []),
                               *served.eos)))
    choices = Choices(request.app.state.worker, tokenizer, body, prompt,
                      max_tokens=body.token_limit, eos=eos, variant=_variant(served, body.model))
    return await _answer(choices, body, request, chat=True, logprobs=body.logprobs)


def _variant(served: Served, model: str) -> int:
    variant = served.variant(model)
    if variant is None:
        raise OpenAIError(404, f"the model {model!r} does not exist: this server has "
                          f"{[served.name, *served.adapters]}", param="model",
                          code="model_not_found")
    return variant


async def _answer(choices: Choices, body, request: Request, *, chat: bool, logprobs: bool):
    """Submit the choices, then stream them or answer once they are done."""
    await choices.start()
    response = Response(choices, body.model, chat=chat, logprobs=logprobs)
    if body.stream:
        return StreamingResponse(response.stream(), media_type="text/event-stream")
    return await _unless_gone(response.whole(), request)


async def _unless_gone(work, request: Request):
    """Await `work`, cancelling it (and so its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
    return task.result()


def _errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: a malformed body 400, a bad field 422, an unknown model
    404."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        problems = error.errors()
        if any(problem["type"] == "json_invalid" for problem in problems):
            return JSONResponse(error_body("the request body is not valid JSON"), 400)
        first = problems[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        message = "; ".join(f"{'.'.join(map(str, p['loc'][1:]))}: {p['msg']}" for p in problems)
        return JSONResponse(error_body(message, param=param), 422)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail), kind="not_found_error"
                                       if error.status_code == 404 else "invalid_request_error"),
                            error.status_code)
