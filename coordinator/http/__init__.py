"""The coordinator's OpenAI-compatible HTTP server (FastAPI + uvicorn): see app.py."""
