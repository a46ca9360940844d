"""pebbling's HTTP server: Ollama's API (and OpenAI's) over pyplugin's engine.

``create_app()`` builds the FastAPI app; ``pebbling serve`` runs it with uvicorn.
"""

from .app import create_app

__all__ = ["create_app"]
