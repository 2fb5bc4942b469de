"""`tfx serve`: an OpenAI-compatible HTTP server over `tfx.generation.Engine` (FastAPI and
uvicorn, the serve extra). One thread owns the engine and the device; HTTP handlers post
requests to it and hear back between steps. Imported only by the command and by code that
serves on purpose (`import tfx` does not import it)."""

from tfx.serve.app import create_app
from tfx.serve.loading import Served, load_served, parse_adapters
from tfx.serve.server import serve, serving

__all__ = ["Served", "create_app", "load_served", "parse_adapters", "serve", "serving"]
