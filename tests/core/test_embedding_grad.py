"""The embedding backward that adds only the looked-up rows into main_grad (embedding_grad.py): the
same bits as autograd's dense gradient accumulated into DDP's buffer, and only where that holds."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.distributed import DistributedDataParallel
from megatron_lite.core.tensor_parallel import VocabParallelEmbedding
from megatron_lite.core.transformer.transformer_config import TransformerConfig

VOCAB, HIDDEN = 96, 16


class _Stage(nn.Module):
    """A first pipeline stage in miniature: embedding, then a layer (untied: nothing else uses it)."""

    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=nn.init.normal_, config=cfg)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids):
        return self.proj(self.embedding(ids))


def _train_grads(fast: bool, dtype=torch.float32, used_elsewhere: bool = False):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True
    )
    stage = _Stage(cfg).to(dtype)
    stage.embedding.weight_used_elsewhere = used_elsewhere
    ddp = DistributedDataParallel(cfg, stage)
    weight = stage.embedding.weight
    if not fast:
        weight.main_grad_is_grad = False  # autograd's dense embedding gradient, as before
    generator = torch.Generator().manual_seed(1)
    names = []
    stage.embedding.register_forward_hook(lambda _m, _i, out: names.append(type(out.grad_fn).__name__))
    for _ in range(4):  # microbatches accumulating into the buffer; few ids, so many repeats
        ids = torch.randint(0, VOCAB // 4, (3, 40), generator=generator)
        out = ddp(ids)
        (out.float() * torch.randn(out.shape, generator=generator)).sum().backward()
    return weight.main_grad.clone(), stage.proj.weight.main_grad.clone(), names


def test_rows_into_main_grad_give_the_dense_gradients_bits():
    emb_fast, proj_fast, names = _train_grads(fast=True)
    emb_dense, proj_dense, dense_names = _train_grads(fast=False)
    assert all("EmbeddingIntoMainGrad" in n for n in names), names
    assert all(n == "EmbeddingBackward0" for n in dense_names), dense_names
    assert torch.equal(emb_fast, emb_dense) and emb_fast.abs().sum() > 0
    assert torch.equal(proj_fast, proj_dense)
    assert (emb_fast[VOCAB // 4 :] == 0).all()  # rows never looked up stay untouched


def test_a_weight_used_elsewhere_or_not_fp32_keeps_autograds_gradient():
    _, _, names = _train_grads(fast=True, used_elsewhere=True)  # e.g. tied to an output layer here
    assert all(n == "EmbeddingBackward0" for n in names)
    _, _, names = _train_grads(fast=True, dtype=torch.bfloat16)  # .grad is not main_grad
    assert all(n == "EmbeddingBackward0" for n in names)


def test_without_ddp_the_weight_gets_a_plain_grad():
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True
    )
    stage = _Stage(cfg)
    ids = torch.tensor([[1, 1, 2]])
    stage(ids).sum().backward()
    grad = stage.embedding.weight.grad
    assert grad is not None and torch.equal(grad[1], 2 * grad[2]) and (grad[3:] == 0).all()
