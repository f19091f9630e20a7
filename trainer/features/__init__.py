"""Every optimization and kernel choice of the trainer, one package each, behind one protocol.

Each package holds its feature object(s) in ``feature.py`` (the activation policy: ``policy.py``)
beside the implementation they install; the Triton kernels are in ``trainer.kernels``. A feature
implements ``trainer.plan.feature.Feature`` (and ``Installable`` when it installs something):

- ``supported(ctx) -> None | reason``: why it can never run for this job here;
- ``decide(ctx) -> Decision``: the job's switch (or, for a kernel choice, ``auto``) turned into a
  decision with a reason; ``on`` that cannot run raises ``PlanError`` naming the hardware and the fix;
- ``apply(model, decision, target) -> handle``: installs what the decision says on a loaded model
  and returns a handle whose ``remove()`` puts the model, and any module-level function it patched,
  back exactly (``describe()`` gives the run's log line, None when nothing was installed).

``registry.PLANNED`` is the order ``trainer.plan.planner.plan`` decides in, ``registry.INSTALLED``
the order ``trainer.training.install.install(model, plan)`` applies in; the train loop and every bench
script install through it. Nothing else in the trainer decides or installs a feature.

| package | feature: decision | what runs |
|---|---|---|
| ``attention`` | ``KERNEL``: ``attention``; ``CACHE``: ``packed_metadata_cache`` (backend: the kernel) | ``ftq_packed`` attention + metadata built once per batch, or per layer |
| ``moe`` | ``moe_grouped_routing`` | argsort + bincount routing, or transformers' eager loop |
| ``checkpointing`` | ``gradient_checkpointing`` | which decoder layers are checkpointed |
| ``offload`` | ``offload_activations`` (backend: ``double`` / ``sync`` reload); ``RELOAD_FEATURE``: ``double_buffered_reload`` | offloaded checkpoints |
| ``lora_kernel`` | ``lora_kernel`` | fused LoRA linears in the compute dtype |
| ``fused_ops`` | ``fused_ops`` | Triton RMSNorm / SwiGLU / RoPE |
| ``loss`` | ``loss`` | fused chunked LM head + cross-entropy, or full logits |

The multi-rank strategy (``parallelism``) is a feature too (``trainer.parallel.strategy.FEATURE``),
applied by ``parallelize`` once the process group exists. The ``attention`` and
``double_buffered_reload`` decisions are partners: their choice is carried in the applied
decision's ``backend`` (a kernel for the cache, a reload mode for the offload), so each ``apply``
reads only its own decision.
"""
