"""The coordinator process: everything of a MoE model that is not a routed expert (embeddings,
attention with its KV cache, norms, router, shared experts, LM head, sampling), the scheduler
and the public APIs, the expert cluster it dispatches routed experts to, and the control plane
that places experts (EPLB) and loads adapters (LoRA).

Subsystems, bottom to top (each may import only those before it; tests/test_layout.py checks):
``model/`` (model execution), ``experts/`` (the expert tier), ``eplb/`` (placement and
rebalancing), ``lora/`` (MoE LoRA adapters), ``serving/`` (servicers, HTTP, scheduler). The
top level holds only ``config.py`` (the frozen service config) and the entry points, which may
import every layer: ``main.py`` (``expertmesh coordinator``: its flags and ``run``) and
``compile_helper.py`` (the process that compiles a CUDA coordinator's kernels while it loads,
model/compile_ahead.py).
"""
