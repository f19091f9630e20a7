"""Per-sequence log-probabilities through the chunked LM head: DPO's policy and reference terms.

Each sequence s of a packed row gets ``logp_s = sum over its label tokens t of log p(label_t)``,
a segment-sum of the token log-probabilities (``-CE`` per token) over the row's sequence ids,
without materialising the ``T x V`` logits: the tokens go through the head in chunks, as in
``trainer.features.loss.fused`` (same chunk size rule, same fp32 log-sum-exp, same soft-capping).

Unlike that loss, the incoming gradient is a vector (one weight per sequence, DPO's
``d loss / d logp_s``), which scales each token's logits gradient before the head-weight gradient
sums over tokens; so the forward keeps only each token's log-sum-exp (fp32, ``T`` floats) and the
backward recomputes each chunk's logits (one extra head matmul, ~1% of an 8B step) instead of
storing gradients. Under ``no_grad`` (the reference pass) nothing is kept.

Legend: ``N`` tokens, ``H`` hidden size, ``V`` vocabulary, ``S`` sequences, ``C`` a chunk's tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.features.loss.fused import IGNORE_INDEX, decoder_and_head, default_chunk_size


class _FusedLinearSequenceLogprobs(torch.autograd.Function):
    """Per-sequence sums of log p(label) (see the module docstring)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        seq_N: torch.Tensor,
        num_seqs: int,
        chunk_size: int,
        softcap: float | None,
        ignore_index: int,
    ) -> torch.Tensor:
        logp_S = torch.zeros(num_seqs, dtype=torch.float32, device=hidden_NH.device)
        lse_N = torch.empty(hidden_NH.shape[0], dtype=torch.float32, device=hidden_NH.device)
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = min(start + chunk_size, hidden_NH.shape[0])
            logits_CV, _ = _chunk_logits(hidden_NH[start:end], weight_VH, softcap)
            valid_C, target_C = _targets(labels_N[start:end], ignore_index)
            lse_N[start:end] = torch.logsumexp(logits_CV, dim=-1)
            picked_C = logits_CV.gather(1, target_C.unsqueeze(1)).squeeze(1)
            logp_S.index_add_(0, seq_N[start:end], torch.where(valid_C, picked_C - lse_N[start:end], 0.0))
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, seq_N, lse_N)
        ctx.chunk_size, ctx.softcap, ctx.ignore_index = chunk_size, softcap, ignore_index
        return logp_S

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_S: torch.Tensor) -> tuple[Any, ...]:
        hidden_NH, weight_VH, labels_N, seq_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        for start in range(0, hidden_NH.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden_NH.shape[0])
            h_CH = hidden_NH[start:end]
            logits_CV, tanh_CV = _chunk_logits(h_CH, weight_VH, ctx.softcap)
            valid_C, target_C = _targets(labels_N[start:end], ctx.ignore_index)
            # d logp_s / d logits_t = onehot(label_t) - softmax_t for t in s, times s's incoming grad
            coef_C = torch.where(valid_C, grad_S.float()[seq_N[start:end]], 0.0)
            grad_CV = torch.exp(logits_CV - lse_N[start:end].unsqueeze(1)) * -coef_C.unsqueeze(1)
            grad_CV.scatter_add_(1, target_C.unsqueeze(1), coef_C.unsqueeze(1))
            if tanh_CV is not None:
                grad_CV *= 1.0 - tanh_CV * tanh_CV
            grad_CV = grad_CV.to(hidden_NH.dtype)
            if need_h:
                grad_h[start:end] = grad_CV @ weight_VH
            if need_w:
                grad_w.addmm_(grad_CV.T.float(), h_CH.float())
            del logits_CV, grad_CV, tanh_CV
        return grad_h, grad_w.to(weight_VH.dtype) if need_w else None, None, None, None, None, None, None


def _chunk_logits(
    h_CH: torch.Tensor, weight_VH: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits, soft-capped when ``softcap`` is set (then also the tanh, for the derivative)."""
    logits_CV = (h_CH @ weight_VH.T).float()
    if softcap is None:
        return logits_CV, None
    tanh_CV = torch.tanh(logits_CV / softcap)
    return softcap * tanh_CV, tanh_CV


def _targets(y_C: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    valid_C = y_C != ignore_index
    return valid_C, torch.where(valid_C, y_C, 0)


def fused_linear_sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each sequence's summed log-probability of its labels, without materialising the logits.

    Args:
        hidden, weight, labels: as in ``fused_linear_cross_entropy``.
        sequence_ids: [...] int64, aligned with ``labels``: the sequence (0 .. num_sequences-1)
            each position belongs to (a packed row's segment ids).
        num_sequences: S, a host int.

    Returns:
        [S] fp32: sum over the label tokens t of sequence s of log p(labels[t]) (0 for none).
    """
    if hidden.shape[:-1] != labels.shape or labels.shape != sequence_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and sequence_ids "
            f"{tuple(sequence_ids.shape)} must agree but for hidden's last dim"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; cast one of them")
    return _FusedLinearSequenceLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        sequence_ids.reshape(-1),
        int(num_sequences),
        chunk_size or default_chunk_size(weight.shape[0]),
        softcap,
        ignore_index,
    )


def causal_lm_sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    **model_kwargs: Any,
) -> torch.Tensor:
    """As ``trainer.features.loss.fused.causal_lm_loss``, but each sequence's summed log p(target): [S] fp32 (DPO, ``trainer.objectives.dpo``)."""
    hidden, weight, softcap = decoder_and_head(model, input_ids, model_kwargs)
    return fused_linear_sequence_logprobs(hidden, weight, targets, sequence_ids, num_sequences, softcap=softcap)
