"""A stand-in for the ``sgl_kernel`` package on SGLang's CPU platform, written in plain torch.

``sglang-kernel`` ships no CPU build on any registry here. On CPU, SGLang 0.5.23 imports two bookkeeping ops from it
at module load (the request-to-token map and the KV-slot move); everything else it needs on CPU has a plain-torch path
that SGLang takes when the AMX ops are absent (RMSNorm, SiLU, RoPE, torch_native attention). These two do what
SGLang's Triton kernels of the same names do. SGLang's speculative-decoding modules also import a few CPU ops at
module load (``UNAVAILABLE``): they are defined here so that the import succeeds, and each raises, naming itself, if
called; miles-lp never enables speculative decoding. Only the SGLang server started by ``miles_lp.rollout.sglang_cpu`` sees
this folder (it is put first on that process's PYTHONPATH); it is not an installed package.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[prefix[i]:prefix[i+1]]``, the slots of
    each request laid one after another in ``out_cache_loc``."""
    del pool_len  # the row length of req_to_token; indexing the tensor carries it
    at = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = int(e) - int(s)
        if n > 0:
            req_to_token[int(row), int(s):int(e)] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += max(n, 0)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For each K/V buffer ``b`` (base address ``data_ptrs[b]``, ``strides[b]`` bytes a slot row):
    ``buf_b[tgt_loc] = buf_b[src_loc]``, every source row read before any target row is written (the locations
    may overlap). SGLang hands raw addresses, so the rows are moved as bytes."""
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    if not tgt:
        return
    for base, row in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(int(base) + int(s) * int(row), int(row)) for s in src]
        for t, data in zip(tgt, rows, strict=True):
            ctypes.memmove(int(base) + int(t) * int(row), data, int(row))


#: the speculative-decoding CPU ops SGLang imports at module load and calls only with speculative decoding on
UNAVAILABLE = ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu",
               "assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
               "rotate_input_ids_cpu")


def _unavailable(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding on CPU needs sglang-kernel's CPU build, "
                                  "which miles-lp's stand-in does not provide (serve without --speculative-*)")
    op.__name__ = name
    return op


for _name in UNAVAILABLE:
    globals()[_name] = _unavailable(_name)
