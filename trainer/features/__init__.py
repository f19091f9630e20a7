"""Every optimization and kernel choice of the trainer, each behind one surface.

A feature module answers three things, and nothing else in the trainer decides or installs it:

- ``supported(hardware, facts) -> None | reason``: why it can never run for this model here.
- ``decide(...) -> Decision``: the job's switch (or, for a kernel choice, ``auto``) turned into a
  decision with a reason, called by ``trainer.plan.planner.plan``; ``on`` that cannot run raises
  ``PlanError`` naming the hardware and the fix.
- ``apply(model, decision) -> handle``: installs what the decision says on a loaded model and
  returns a handle whose ``remove()`` puts the model, and any module-level function it patched,
  back exactly (``describe()`` gives the run's log line, None when nothing was installed).

``trainer.run.install.install(model, plan)`` applies a whole plan and returns one handle; the train
loop and every bench script install through it.

| module | decision it applies | what runs |
|---|---|---|
| ``attention`` | ``packed_metadata_cache`` (backend: the ``attention`` kernel) | ``ftq_packed`` attention + metadata built once per batch, or per layer |
| ``moe`` | ``moe_grouped_routing`` | argsort + bincount routing, or transformers' eager loop |
| ``offload`` | ``offload_activations`` (backend: ``double`` / ``sync`` reload) | offloaded checkpoints |
| ``lora_kernel`` | ``lora_kernel`` | fused LoRA linears in the compute dtype |
| ``fused_ops`` | ``fused_ops`` | Triton RMSNorm / SwiGLU / RoPE |
| ``loss`` | ``loss`` | fused chunked LM head + cross-entropy, or full logits |

The ``attention`` and ``double_buffered_reload`` decisions are made by the modules that apply
their partners (a kernel for the cache, a reload mode for the offload) and carried in the applied
decision's ``backend``, so each ``apply`` reads only its own decision.
"""
