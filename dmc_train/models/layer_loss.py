"""Losses computed inside layers that join the (pipeline) backward through the activations.

A method whose loss lives in the layers (DMC-C's constraint, LESS's per-layer distillation) cannot hand
it to the loss function: that runs on the last pipeline stage only. Instead the loss rides on an
activation and receives its gradient when the backward passes through it, on every stage:

- :class:`AttachLoss`: ``AttachLoss.apply(x, loss, weight)`` returns ``x``; in backward ``x``'s gradient
  passes through and ``loss`` receives ``weight`` (DMC-C, inside a layer whose weights also train).
- :func:`attach_layer_losses`: for a frozen model whose layers each compute a loss on the side (LESS):
  every layer's output is its own detached result, chained to its input by :class:`LayerLoss`, so the
  backward visits every layer's loss and nothing else: no gradient through the frozen layers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class AttachLoss(torch.autograd.Function):
    """``AttachLoss.apply(x, loss, weight)`` returns ``x``; in backward ``loss`` receives gradient
    ``weight``, so an auxiliary loss computed inside a layer joins the (pipeline) backward through the
    activations that carry it."""

    @staticmethod
    def forward(ctx, x, loss, weight):
        ctx.weight = weight
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.loss_shape, ctx.weight, dtype=ctx.loss_dtype, device=grad.device), None


class LayerLoss(torch.autograd.Function):
    """``LayerLoss.apply(output, previous, loss, weight)`` returns a copy of ``output`` (a detached result);
    in backward the incoming gradient goes to ``previous`` (the layer's input: the chain to the earlier
    layers and stages) and ``loss`` receives ``weight``."""

    @staticmethod
    def forward(ctx, output, previous, loss, weight):
        ctx.weight, ctx.loss_shape, ctx.loss_dtype = weight, loss.shape, loss.dtype
        ctx.previous_dtype = previous.dtype
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        loss_grad = torch.full(ctx.loss_shape, ctx.weight, dtype=ctx.loss_dtype, device=grad.device)
        return None, grad.to(ctx.previous_dtype), loss_grad, None


def attach_layer_losses(layers: list[torch.nn.Module], take_loss: Callable[[torch.nn.Module], Optional[torch.Tensor]],
                        weight: Callable[[torch.Tensor], float]) -> None:
    """Hook each layer of ``layers`` (megatron ``TransformerLayer``: ``hidden_states`` in, ``(output,
    context)`` out) so that it runs on a detached input and its output carries the loss ``take_loss(layer)``
    left by its forward, weighted by ``weight(hidden_states)`` (e.g. the micro-batch's tokens)."""

    def before(layer, args, kwargs):
        hidden = kwargs["hidden_states"]
        layer._layer_loss_input = hidden
        kwargs["hidden_states"] = hidden.detach()
        return args, kwargs

    def after(layer, args, kwargs, result):
        output, context = result
        previous = layer.__dict__.pop("_layer_loss_input")
        loss = take_loss(layer)
        if loss is None or not torch.is_grad_enabled() or not loss.requires_grad:
            return result
        if not previous.requires_grad:  # the first layer of the first stage: nothing to chain to
            previous = previous.detach().requires_grad_(True)
        return LayerLoss.apply(output.detach(), previous, loss, weight(output)), context

    for layer in layers:
        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_hook(after, with_kwargs=True)
