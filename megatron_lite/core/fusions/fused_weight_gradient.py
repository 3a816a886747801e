"""Weight gradients added straight into the fp32 ``main_grad`` (megatron-core's gradient-accumulation
fusion: ``--no-gradient-accumulation-fusion`` turns it off in Megatron-LM, where it is on by default).

Unfused, a linear's backward makes its weight gradient ``grad_output^T input`` as a weight-sized tensor
of the weight's dtype, and DDP adds it into ``main_grad`` afterwards. Fused, nothing weight-sized is made:
apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` (or Transformer Engine's GEMM with
``accumulate``) has the GEMM add its fp32 result into ``main_grad``. Here:

- same dtypes (fp32 training): ``addmm_`` in place;
- bf16 / fp16 into fp32 on CUDA: the same GEMM with an fp32 output (``aten::addmm.dtype_out``, torch
  2.10 or later), in place;
- bf16 / fp16 into fp32 elsewhere (no such kernel on the CPU): the tokens a budget's worth at a time,
  upcast and added with an fp32 ``addmm_``; the products of bf16 values are exact in fp32, so every
  path sums in fp32 as the CUDA kernel does and nothing is rounded to bf16 on the way.
"""

from __future__ import annotations

import torch

from megatron_lite.core.process_group_utils import kernel_device_type

# aten::addmm.dtype_out accepts an fp32 ``self`` with bf16 / fp16 matrices from torch 2.10 on (pytorch
# #167931); before, CUDA takes the upcast slices too.
FP32_OUTPUT_GEMM = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 10)

# Bytes a budgeted temporary may take on each kind of device: one chunk of the fused loss's fp32
# logits, or one slice of tokens upcast for the weight gradient: small beside a layer's activations.
CHUNK_BUDGET_BYTES = {"cuda": 64 << 20, "cpu": 32 << 20}


def rows_in_budget(row_bytes: int, device_type: str) -> int:
    """The device's budget's worth of rows of ``row_bytes`` each, at least one."""
    return max(1, CHUNK_BUDGET_BYTES.get(device_type, CHUNK_BUDGET_BYTES["cuda"]) // row_bytes)


def upcast_token_rows(in_features: int, out_features: int, device_type: str) -> int:
    """Tokens per slice when a bf16 weight gradient is upcast to be added into ``main_grad`` without an
    fp32-output GEMM: the budget's worth of both operands' fp32 rows; 0 where no slice is needed."""
    if device_type == "cuda" and FP32_OUTPUT_GEMM:
        return 0
    return rows_in_budget(4 * (in_features + out_features), device_type)


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T total_input`` over all tokens, with no weight-sized temporary (apex's
    name and argument order). ``total_input`` [..., in], ``grad_output`` [..., out], ``main_grad`` [out, in]."""
    x = total_input.reshape(-1, total_input.size(-1))
    g = grad_output.reshape(-1, grad_output.size(-1))
    if g.dtype == main_grad.dtype:
        main_grad.addmm_(g.t(), x)
        return
    rows = upcast_token_rows(x.size(1), g.size(1), kernel_device_type(main_grad))
    if rows == 0:
        torch.ops.aten.addmm.dtype_out(main_grad, g.t(), x, main_grad.dtype, out=main_grad)
        return
    for start in range(0, x.size(0), rows):
        part = slice(start, start + rows)
        main_grad.addmm_(g[part].t().to(main_grad.dtype), x[part].to(main_grad.dtype))
