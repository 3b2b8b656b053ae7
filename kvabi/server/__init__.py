"""The OpenAI-compatible HTTP server: FastAPI routes over an engine run by a background thread."""
