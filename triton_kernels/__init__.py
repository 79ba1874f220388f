"""GPU kernels of hpcfl, each beside a pure-torch reference of the same signature.

Every kernel module exposes ``<name>_reference`` (pure torch, used on CPU and as the tests' ground
truth), ``<name>_triton`` (the Triton kernel; runs on CUDA tensors, or on CPU under
``TRITON_INTERPRET=1``) and a dispatcher ``<name>`` that picks Triton for CUDA tensors. Triton is
optional: without it the package imports and the dispatchers use the references.

Kernels: the subsampled per-sample gradient gathers of the eNTK fast path (:mod:`hpcfl.entk`):
:func:`linear_gather`, :func:`conv2d_gather`, :func:`norm_weight_gather`, :func:`channel_sum_gather`.
"""

from triton_kernels._triton import HAS_TRITON as HAS_TRITON
from triton_kernels.entk_conv import conv2d_gather as conv2d_gather
from triton_kernels.entk_conv import conv2d_gather_reference as conv2d_gather_reference
from triton_kernels.entk_conv import conv2d_gather_triton as conv2d_gather_triton
from triton_kernels.entk_linear import linear_gather as linear_gather
from triton_kernels.entk_linear import linear_gather_reference as linear_gather_reference
from triton_kernels.entk_linear import linear_gather_triton as linear_gather_triton
from triton_kernels.entk_norm import channel_sum_gather as channel_sum_gather
from triton_kernels.entk_norm import channel_sum_gather_reference as channel_sum_gather_reference
from triton_kernels.entk_norm import channel_sum_gather_triton as channel_sum_gather_triton
from triton_kernels.entk_norm import norm_weight_gather as norm_weight_gather
from triton_kernels.entk_norm import norm_weight_gather_reference as norm_weight_gather_reference
from triton_kernels.entk_norm import norm_weight_gather_triton as norm_weight_gather_triton

__all__ = [
    "HAS_TRITON",
    "channel_sum_gather",
    "channel_sum_gather_reference",
    "channel_sum_gather_triton",
    "conv2d_gather",
    "conv2d_gather_reference",
    "conv2d_gather_triton",
    "linear_gather",
    "linear_gather_reference",
    "linear_gather_triton",
    "norm_weight_gather",
    "norm_weight_gather_reference",
    "norm_weight_gather_triton",
]
