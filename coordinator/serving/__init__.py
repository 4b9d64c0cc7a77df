"""Serving: the gRPC servicers (``server.py``: Generation, Admin, health, reflection, and the
process that wires every layer together), the OpenAI-compatible HTTP server (``http/``), the
continuous-batching scheduler, request parsing and limits, sampling, tokenizer and chat
templates, Prometheus metrics, status and graceful drain.

May import: every other coordinator layer (``model``, ``experts``, ``eplb``, ``lora``) and
``expertmesh``. It is the top layer: nothing below imports it.
"""
