"""A CPU stand-in for SGLang's kernel package `sgl_kernel` (PyPI `sglang-kernel`), for the
real-engine tests only (scripts/sglang-engine-venv.sh copies it into the SGLang venv).

PyPI serves `sglang-kernel` only as a CUDA build (no sdist, no CPU wheel), yet SGLang 0.5.23
imports `sgl_kernel` on every device. Without the real package's CPU ops registered under
`torch.ops.sgl_kernel`, SGLang's `cpu_has_amx_support()` is false (even on a CPU with AMX) and
its CPU path computes with plain torch. The only kernel functions that path then calls are the
two KV-cache index helpers below, written here in torch: enough for its scheduler, radix cache,
KV-event recorder and ZMQ publisher to run unchanged on a CPU.

Its CPU modules also import, when they are loaded, a few kernels of speculative decoding, which
the tests never turn on: those names exist (so the imports pass) and raise NotImplementedError
when called. Any other name is missing: asking for it raises `KernelMissing`, both an
AttributeError (so `from sgl_kernel import x` is an ImportError and `hasattr` is false, as
SGLang's guarded imports expect of an absent kernel) and a NotImplementedError.
"""
import ctypes

import torch

__version__ = "0.0.0+kvbridge.cpu.standin"

_WHERE = "kvbridge's CPU stand-in of sgl_kernel (tests/real_engine/sgl_kernel_cpu)"


class KernelMissing(AttributeError, NotImplementedError):
    pass


def __getattr__(name):
    raise KernelMissing(f"sgl_kernel.{name} is not in {_WHERE}")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Writes the KV slots just allocated (`out_cache_loc`, every request's run back to back)
    into each request's row of the token pool: row `req_pool_indices[i]`, columns
    `start_offset[i]:end_offset[i]`. Called for every prefill and decode step."""
    del pool_len  # the row width, which req_to_token's shape carries here
    out = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[out : out + n].to(req_to_token.dtype)
        out += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copies KV rows `src_loc[j]` to `tgt_loc[j]` in every layer's buffer, given as raw addresses
    (`data_ptrs`) and row sizes in bytes (`strides`). Every source row is read before any is
    written, so overlapping moves are safe, as in SGLang's Triton kernel. SGLang calls it once at
    start (a warm-up copying row 0 onto itself) and whenever it moves KV rows in place."""
    pairs = list(zip(src_loc.tolist(), tgt_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + src * stride, stride) for src, _ in pairs]
        for (_, tgt), row in zip(pairs, rows):
            ctypes.memmove(base + tgt * stride, row, stride)


def _speculative_only(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} (speculative decoding) is not implemented by {_WHERE}"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# Imported by sglang/kernels/ops/speculative/{cache_locs,eagle,multi_layer_eagle,spec_tree}.py
# when the device is the CPU; called only with speculative decoding on.
for _name in (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _speculative_only(_name)
del _name
