"""Model execution: the model zoo (``models/``: one module per architecture, built on the meta
device and filled from safetensors by ``loader.py``), attention and its paged KV cache
(``kv_cache.py``), the router, the fused kernels (``kernels/``), the batch a step runs on, the
engine that runs one forward step, CUDA graphs of the decode step (``cuda_graphs.py`` with every
expert in process, ``remote_graphs.py`` cut at each remote dispatch), and the ``Dispatcher``
interface through which a MoE layer hands its routed experts to whoever computes them
(``dispatch.py``; ``deferral.py`` holds back CPU-expert sums by one layer).

May import: ``expertmesh`` and itself. It is the bottom layer of the coordinator: the expert tier
implements its ``Dispatcher``; the LoRA manager and serving sit above it (the engine names the
LoRA manager and the remote dispatcher for types only).
"""
