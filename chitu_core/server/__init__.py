"""The OpenAI-compatible HTTP server: FastAPI app, request/response schemas, auth, metrics.

``python -m chitu_core.serve`` builds an ``AsyncLLM`` from a ``ServeConfig`` and
serves ``build_app(...)`` with uvicorn.
"""
