"""`fastgen serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`."""
