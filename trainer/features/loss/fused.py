"""Fused, chunked linear + cross-entropy: the LM head and the loss without the full logits.

Why: the LM head's logits are ``T x V``; for a 16,384-token step and Llama-3's 128,256-token
vocabulary that is 4.2 GB in bf16, 8.4 GB as the fp32 copy the loss upcasts to, and as much
again for their gradient: more than the rest of a LoRA step. Here the tokens are cut into
chunks; per chunk the forward computes the logits (fp32), the loss sum over label tokens and,
when training, the gradient w.r.t. the hidden states (and w.r.t. the head weight only when it
requires grad), then drops the chunk's logits. Backward only scales the stored gradients by
the incoming scalar. Peak extra memory is one chunk's logits and their gradient, ~12 bytes x
``chunk_size x V`` (0.75 GiB for 512 x 128k), plus ``T x H`` for the hidden-state gradient:
~21 GB of logits, fp32 logits and their gradient saved at 16k tokens x 128k vocabulary.
Same algorithm as Liger-Kernel's ``fused_linear_cross_entropy``, in plain PyTorch (the matmuls
dominate; a Triton softmax would save little).

The loss is ``sum over label tokens of -log p(label) / num_items``. Pass ``num_items`` = the
number of label tokens (``!= ignore_index``) in the whole optimizer step (all micro-batches of a
gradient-accumulation group): each micro-batch then contributes exactly its share and the
accumulated gradient equals that of one big batch, each label token counted once. Leave it
None to divide by this call's own label count (a device tensor; no host sync either way).

Precision: bf16/fp16 hidden states and weight are multiplied with fp32 accumulation inside the
matmul and the chunk's logits are upcast to fp32 (as stock transformers and Liger do: the logits
are rounded to the input dtype once); log-sum-exp, softmax and the loss are fp32; the logits
gradient is cast back to the input dtype for the two gradient matmuls (as Liger does); the
head-weight gradient accumulates in fp32. Under autocast the matmuls follow autocast.

Shapes (legend): ``N`` tokens, ``H`` hidden size, ``V`` vocabulary.

With an HF model (``causal_lm_loss``): run the decoder (``lm.model``) for the hidden states,
then this loss on ``lm.lm_head.weight``. Tied embeddings need nothing special (the head weight
*is* the embedding matrix). Gemma 2/3's ``final_logit_softcapping`` is applied per chunk
(``cap * tanh(logits / cap)``, its derivative folded into the gradient). Models that scale
logits another way (``logit_scale``, ``logits_scaling``), heads with a bias, or a peft-wrapped
head are refused by ``supported`` with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.objectives import token_accuracy
from trainer.kernels import cross_entropy
from trainer.plan.memory import default_chunk_size

IGNORE_INDEX = -100
class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        num_items: Any,
        chunk_size: int,
        softcap: float | None,
        ignore_index: int,
        grad_enabled: bool,
        kernel: bool = False,
    ) -> torch.Tensor:
        # grad mode is always off inside forward: the caller says whether a backward can follow
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        n_tokens = hidden_NH.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
            if need_w
            else None
        )
        if num_items is None:
            num_items = (labels_N != ignore_index).sum().clamp(min=1).float()
        inv_items = 1.0 / num_items
        for start in range(0, n_tokens, chunk_size):
            end = min(start + chunk_size, n_tokens)
            h_CH = hidden_NH[start:end]
            y_C = labels_N[start:end]
            chunk_loss, grad_CV = (_kernel_chunk if kernel else _torch_chunk)(
                h_CH, weight_VH, y_C, inv_items, softcap, ignore_index, need_h or need_w
            )
            loss_sum += chunk_loss
            if grad_CV is None:
                continue
            if need_h:
                grad_h[start:end] = grad_CV @ weight_VH
            if need_w:
                grad_w.addmm_(grad_CV.T.float(), h_CH.float())
            del grad_CV
        ctx.save_for_backward(
            grad_h if grad_h is not None else torch.empty(0),
            grad_w.to(weight_VH.dtype) if grad_w is not None else torch.empty(0),
        )
        return loss_sum * inv_items

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = grad_w * grad_out.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None


def _torch_chunk(
    h_CH: torch.Tensor, weight_VH: torch.Tensor, y_C: torch.Tensor, inv_items: Any,
    softcap: float | None, ignore_index: int, want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk in torch: (its loss sum, the logits' gradient in the hidden dtype or None)."""
    logits_CV = (h_CH @ weight_VH.T).float()
    tanh_CV = None
    if softcap is not None:
        tanh_CV = torch.tanh(logits_CV / softcap)
        logits_CV = softcap * tanh_CV
    valid_C = y_C != ignore_index
    target_C = torch.where(valid_C, y_C, 0)
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    picked_C = logits_CV.gather(1, target_C.unsqueeze(1)).squeeze(1)
    chunk_loss = torch.where(valid_C, lse_C - picked_C, 0.0).sum()
    token_accuracy.add(logits_CV, y_C, valid_C)
    if not want_grad:
        return chunk_loss, None
    # d(loss)/d(logits) = softmax - onehot(label), zero on ignored rows, / num_items
    grad_CV = torch.exp(logits_CV - lse_C.unsqueeze(1))
    grad_CV.scatter_add_(1, target_C.unsqueeze(1), torch.full_like(picked_C, -1.0).unsqueeze(1))
    grad_CV *= (valid_C.float() * inv_items).unsqueeze(1)
    if tanh_CV is not None:
        grad_CV *= 1.0 - tanh_CV * tanh_CV
    return chunk_loss, grad_CV.to(h_CH.dtype)


def _kernel_chunk(
    h_CH: torch.Tensor, weight_VH: torch.Tensor, y_C: torch.Tensor, inv_items: Any,
    softcap: float | None, ignore_index: int, write_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk through ``trainer.kernels.cross_entropy``: (its loss sum, the logits' gradient,
    written over the logits, or None). Counts token accuracy too."""
    logits_CV = h_CH @ weight_VH.T
    loss_C, hit_C = cross_entropy.ce_rows_(logits_CV, y_C, inv_items, softcap, ignore_index, write_grad)
    token_accuracy.add_hits(hit_C)
    return loss_C.sum(), logits_CV if write_grad else None


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_items: Any) -> None:
    """``fused_linear_cross_entropy``'s argument checks (its Raises)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} minus the last dim"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, {hidden.shape[-1]}], got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; cast one of them"
        )
    if isinstance(num_items, (int, float)) and num_items <= 0:
        raise ValueError(
            f"num_items must be > 0 (the step's label-token count), got {num_items}"
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items: float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    kernel: bool | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the logits.

    Args:
        hidden: [..., H] final hidden states (after the final norm), bf16/fp16/fp32.
        weight: [V, H] LM-head weight (same dtype as ``hidden``).
        labels: [...] int64 targets aligned with ``hidden`` (already shifted: ``labels[t]`` is
            the token position t predicts), ``ignore_index`` where there is none.
        num_items: the label-token count to divide by (the whole step's, for exact gradient
            accumulation); None divides by this call's own count.
        chunk_size: tokens per chunk; None picks ``default_chunk_size(V)``.
        softcap: final-logit soft-capping (Gemma 2/3), or None.
        ignore_index: label value that contributes nothing.
        kernel: each chunk's softmax, loss and gradient in one Triton kernel
            (``trainer.kernels.cross_entropy``); None: on CUDA when Triton is installed.

    Returns:
        The scalar fp32 loss: sum of per-token NLL over label tokens / ``num_items``.

    Raises:
        ValueError: mismatched shapes or dtypes, or a non-positive ``num_items``/``chunk_size``.
    """
    _check_inputs(hidden, weight, labels, num_items)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    return _FusedLinearCrossEntropy.apply(
        hidden_NH,
        weight,
        labels.reshape(-1),
        num_items,
        chunk_size,
        softcap,
        ignore_index,
        torch.is_grad_enabled(),
        cross_entropy.available(hidden.device) if kernel is None else kernel,
    )


# -- with an HF causal LM ------------------------------------------------------------------------


def supported(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot stand in for ``model``'s own LM head + loss, or None."""
    lm = _unwrap(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None:
        return f"{type(lm).__name__} has no output embeddings (LM head)"
    if type(head) is not torch.nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain Linear (a peft-adapted head is not supported)"
    if head.bias is not None:
        return "the LM head has a bias, which the fused loss does not add"
    text = (
        lm.config.get_text_config()
        if hasattr(lm.config, "get_text_config")
        else lm.config
    )
    for name in ("logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(text, name, None) not in (None, 1, 1.0):
            return f"{text.model_type} scales its logits ({name}={getattr(text, name)}), which the fused loss does not"
    if not hasattr(lm, lm.base_model_prefix):
        return f"{type(lm).__name__} has no decoder attribute {lm.base_model_prefix!r} to run for hidden states"
    return None


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items: float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Run ``model``'s decoder and the fused loss on its LM head, for already-shifted ``targets``.

    Args:
        model: an HF ``XForCausalLM`` or a peft model around one.
        input_ids: [B, T] token ids.
        targets: [B, T] next-token targets (``trainer.data.packing.PackedBatch.targets``), -100 where none.
        num_items: the step's label-token count (see ``fused_linear_cross_entropy``).
        chunk_size: tokens per chunk (None: ``default_chunk_size``).
        **model_kwargs: passed to the decoder, e.g. ``**meta.model_kwargs()``.

    Raises:
        ValueError: ``supported(model)`` names a reason.
    """
    hidden, weight, softcap = decoder_and_head(model, input_ids, model_kwargs)
    return fused_linear_cross_entropy(
        hidden, weight, targets, num_items=num_items, chunk_size=chunk_size, softcap=softcap
    )


def decoder_and_head(
    model: torch.nn.Module, input_ids: torch.Tensor, model_kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """The decoder's final hidden states (in the head's dtype), the head weight and the soft-cap:
    what a chunked head kernel needs (this loss, ``trainer.objectives.fused_logprobs``).

    Raises:
        ValueError: ``supported(model)`` names a reason.
    """
    reason = supported(model)
    if reason is not None:
        raise ValueError(f"fused linear cross-entropy cannot run this model: {reason}")
    lm = _unwrap(model)
    decoder = getattr(lm, lm.base_model_prefix)
    hidden = decoder(input_ids=input_ids, use_cache=False, **model_kwargs).last_hidden_state
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    weight = lm.get_output_embeddings().weight
    return hidden.to(weight.dtype), weight, getattr(text, "final_logit_softcapping", None)


def _unwrap(model: torch.nn.Module) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
