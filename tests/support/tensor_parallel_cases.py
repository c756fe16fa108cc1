"""What each rank runs in the tensor-slicing tests (module-level so that spawned processes import it)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.tensor_parallel import apply_tensor_parallel, sliced_region_rng, tensor_slices

VOCAB = 64


def make_config(**overrides) -> TNLGConfig:
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, fused_kernels="none",
    )  # fmt: skip
    fields.update(overrides)
    return TNLGConfig(**fields)


def make_model(seed: int = 0, **overrides) -> TNLGForCausalLM:
    """The tiny model with random (not zero) biases and LayerNorms, so that every slice is tested."""
    torch.manual_seed(seed)
    model = TNLGForCausalLM(make_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 12), generator=generator)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt with no loss
    labels[2, -3:] = -100
    return ids, labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train_case(rank: int, world_size: int) -> dict:
    """Loss, gradients, one SGD step and the logits of the tiny model, full and cut over all ranks."""
    ids, labels = batch()
    reference = make_model()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the cut: must still work
    before = {n: id(p) for n, p in model.named_parameters()}

    ref_loss = reference(ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = _grads(reference)
    ref_counted = reference(ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss.detach()

    group = dist.new_group(list(range(world_size)))
    slices = apply_tensor_parallel(model, group)
    same_params = before == {n: id(p) for n, p in model.named_parameters()}
    try:
        apply_tensor_parallel(model, group)
        twice = None
    except RuntimeError as error:
        twice = str(error)

    model.train()
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = _grads(model)
    counted = model(ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss.detach()

    # One step of the optimizer built before the cut, then the loss again, on both sides.
    optimizer.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    with torch.no_grad():
        stepped = model(ids, labels=labels).loss
        ref_stepped = reference(ids, labels=labels).loss

    # Logits without labels are gathered to the full vocabulary; gradients flow back through them.
    model.zero_grad()
    reference.zero_grad()
    logits = model(ids).logits
    ref_logits = reference(ids).logits
    (logits.square().mean()).backward()
    (ref_logits.square().mean()).backward()

    model.eval()
    reference.eval()
    generated, ref_generated = [], []
    for cache in (None, "static"):  # the KV cache holds this rank's heads only
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
        generated.append(model.generate(ids[:2, :6], **options))
        ref_generated.append(reference.generate(ids[:2, :6], **options))
    return {
        "slices": {n: (s.dim, s.parts, s.degree, s.rank) for n, s in slices.items()},
        "recorded": sorted(tensor_slices(model)) == sorted(slices),
        "same_params": same_params,
        "twice": twice,
        "loss": out.loss.detach(),
        "ref_loss": ref_loss.detach(),
        "logits_with_labels": out.logits,
        "counted": counted,
        "ref_counted": ref_counted,
        "grads": grads,
        "ref_grads": ref_grads,
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "stepped": stepped,
        "ref_stepped": ref_stepped,
        "logits": logits.detach(),
        "ref_logits": ref_logits.detach(),
        "logit_grads": _grads(model),
        "ref_logit_grads": _grads(reference),
        "generated": torch.stack(generated),
        "ref_generated": torch.stack(ref_generated),
    }


def apply_error_case(rank: int, world_size: int, hidden_size: int, num_attention_heads: int) -> str:
    """The message `apply_tensor_parallel` raises for a config the degree cannot cut."""
    model = make_model(hidden_size=hidden_size, num_attention_heads=num_attention_heads)
    try:
        apply_tensor_parallel(model, dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return ""


def dropout_case(rank: int, world_size: int, seed_by_rank: bool = False, **rates: float) -> dict:
    """One training forward and backward with dropout, full and cut, from the same RNG state."""
    ids, labels = batch()
    reference = make_model(**rates)
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, dist.group.WORLD)
    model.eval()
    with torch.no_grad():
        model(ids, labels=labels)  # evaluation draws no masks: no check
    reference.train()
    model.train()
    torch.manual_seed(7)
    ref_loss = reference(ids, labels=labels).loss
    ref_loss.backward()
    torch.manual_seed(7 + rank if seed_by_rank else 7)
    try:
        loss = model(ids, labels=labels).loss
    except ValueError as error:
        return {"error": str(error)}
    loss.backward()
    after = torch.rand(4)  # the default stream advanced alike on every rank
    with sliced_region_rng(model.model.layers[0].self_attn.qkv_proj, torch.device("cpu")):
        sliced = torch.rand(4)  # differs across ranks
    return {
        "slices": {n: (s.dim, s.parts, s.degree, s.rank) for n, s in tensor_slices(model).items()},
        "loss": loss.detach(),
        "ref_loss": ref_loss.detach(),
        "grads": _grads(model),
        "ref_grads": _grads(reference),
        "after": after,
        "sliced": sliced,
    }


def dropout_rates_case(rank: int, world_size: int, seed_by_rank: bool) -> dict:
    return {
        "residual": dropout_case(rank, world_size, seed_by_rank, embedding_dropout=0.1, hidden_dropout=0.1),
        "attention": dropout_case(rank, world_size, seed_by_rank, attention_dropout=0.1),
    }


def pretrained_case(rank: int, world_size: int, path: str) -> dict:
    """Transformers' DTensor tensor parallelism (`tp_plan="auto"`) on the saved tiny model."""
    # Transformers builds its mesh on the accelerator it finds: hide GPUs so that the gloo group serves.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    model = TNLGForCausalLM.from_pretrained(path, tp_plan="auto")
    model.eval()
    ids, labels = batch()
    with torch.no_grad():
        out = model(ids, labels=labels)
    generated = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
    qkv = model.model.layers[0].self_attn.qkv_proj
    local_rows = [getattr(p, "to_local", lambda p=p: p)().shape[0] for p in (qkv.weight, qkv.bias)]
    logits = out.logits
    if hasattr(logits, "full_tensor"):  # a DTensor would be a regression: the head gathers its output
        logits = logits.full_tensor()
    return {
        "logits": logits.detach().clone(),
        "loss": out.loss.detach().clone(),
        "generated": generated,
        "local_rows": local_rows,
    }


def checkpointed_dropout_case(rank: int, world_size: int) -> dict:
    """Activation checkpointing recomputes the same dropout masks, sliced and replicated."""
    ids, labels = batch()
    plain = make_model(attention_dropout=0.2, hidden_dropout=0.1)
    checkpointed = copy.deepcopy(plain)
    for model in (plain, checkpointed):
        apply_tensor_parallel(model, dist.group.WORLD)
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)  # the newer name
    (enable or checkpointed.gradient_checkpointing_enable)()
    losses = []
    for model in (plain, checkpointed):
        model.train()
        torch.manual_seed(3)
        loss = model(ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    return {"losses": losses, "grads": _grads(plain), "checkpointed": _grads(checkpointed)}


def _message(function, *args) -> str:
    """The error `function(*args)` raises (type and message), or "no error"."""
    try:
        function(*args)
    except (IndexError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def out_of_range_case(rank: int, world_size: int) -> dict[str, str]:
    """Ids and labels outside the vocabulary, through the cut embedding and the vocabulary-parallel loss,
    eager and compiled whole (`fullgraph`: the check must not break the graph)."""
    from tnlg.modeling.tensor_parallel import vocab_parallel_causal_lm_loss

    model = make_model()
    apply_tensor_parallel(model, dist.group.WORLD)
    embed = model.model.embed_tokens
    hidden = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def loss(labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_causal_lm_loss(model.lm_head, hidden, labels)

    compiled_embed = torch.compile(embed, backend="aot_eager", fullgraph=True)
    compiled_loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
    results = {}
    for id_ in (VOCAB, -1):
        ids = torch.tensor([[1, 2, id_, 4]])
        results[f"id {id_}"] = _message(embed, ids)
        results[f"id {id_} compiled"] = _message(compiled_embed, ids)
        results[f"label {id_}"] = _message(loss, ids)
        results[f"label {id_} compiled"] = _message(compiled_loss, ids)
        results[f"label {id_} model"] = _message(lambda i=ids: model(torch.tensor([[1, 2, 3, 4]]), labels=i))
    valid = torch.tensor([[1, -100, VOCAB - 1, 0]])
    with torch.no_grad():
        results["valid"] = (
            loss(valid),
            compiled_loss(valid),
            embed(valid.clamp(min=0)),
            compiled_embed(valid.clamp(min=0)),
        )
    return results


def transformers_heads_case(rank: int, world_size: int) -> str:
    """What apply_tensor_parallel says of a Mistral whose one key/value head cannot be cut in two."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    try:
        apply_tensor_parallel(MistralForCausalLM(config), dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"
