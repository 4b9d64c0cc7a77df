"""The coordinator's OpenAI-compatible HTTP server (FastAPI + uvicorn): ``app.py`` builds the
routes (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` with SSE, ``/health``,
``/metrics``), ``protocol.py`` the request and error JSON, ``limits.py`` body limits,
``serving.py`` and ``generate.py`` run requests through the scheduler, ``server.py`` starts it."""
