"""Tensor-parallel plans for models users bring, in torch's own vocabulary (``parallelize_module``).

optpass compiles whatever plan a model was given (docs/tensor_parallel.md); this is torchtitan's
Llama plan written for Hugging Face ``transformers``' ``LlamaForCausalLM``, so that a user, the
tests, the benches and ``examples/torchtitan_train.py`` apply the same one.
"""

from __future__ import annotations

import torch

from optpass.errors import OptpassError


def hugging_face_llama(model: torch.nn.Module, mesh, *, sequence_parallel: bool = True,
                       loss_parallel: bool = False) -> torch.nn.Module:
    """Apply torchtitan's Llama plan to a Hugging Face ``LlamaForCausalLM`` on a 1-D mesh.

    Column-parallel q/k/v and gate/up projections, row-parallel o and down projections, the
    embedding's rows and the head's columns sharded. With ``sequence_parallel`` the norms and the
    residual stream are split along the sequence; the split starts at the first decoder layer's input,
    because Hugging Face's rotary embedding reads the whole sequence. With ``loss_parallel`` the head's
    output stays sharded along the vocabulary (a DTensor), for ``torch.distributed.tensor.parallel.
    loss_parallel()`` around the compiled step's call.

    Args:
        model: a ``LlamaForCausalLM`` (``model.model.layers``, ``model.lm_head``).
        mesh: the tensor-parallel ``DeviceMesh`` (``mesh["tp"]`` of a 2-D mesh).
        sequence_parallel: split the norms' activations along the sequence (torchtitan's default).
        loss_parallel: keep the logits sharded along the vocabulary.

    Returns:
        ``model``, its planned parameters now DTensors.

    Raises:
        OptpassError: the head's weight is the embedding's (``tie_word_embeddings=True``): torch's
            ``parallelize_module`` replaces each module's parameter by a DTensor of its own, so the
            two would silently train apart (measured: 0.58 relative from one process after 3 steps,
            eagerly, without optpass).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    head, embedding = getattr(model.lm_head, "weight", None), getattr(model.model.embed_tokens, "weight", None)
    if head is not None and head is embedding:
        raise OptpassError(
            "optpass.plans.hugging_face_llama: this model's head shares its weight with the embedding "
            "(tie_word_embeddings=True); torch's parallelize_module gives each module a DTensor of its own, so "
            "the two would train apart, silently, with or without optpass. Build the model with "
            "tie_word_embeddings=False (torchtitan's Llama is untied), or leave it unplanned.")
    split = Shard(1) if sequence_parallel else Replicate()
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
           "lm_head": ColwiseParallel(input_layouts=split, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)}
    if sequence_parallel:
        top["model.layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                   use_local_output=True)
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.model.layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=split),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=split)}
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(layer, mesh, plan)
    return model
