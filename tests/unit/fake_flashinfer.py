"""A stand-in for the `flashinfer` package on a machine without CUDA: its wrappers record how Tandem builds,
plans and runs them (constructor arguments, plan arguments, the buffers given for CUDA graphs), and `run`
computes attention with the torch backend's arithmetic from what plan() was given, so a CPU test checks
both the calls and what FlashInfer would be asked to read (pages, lengths, padding rows)."""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


class _Wrapper:
    def __init__(self, workspace, layout, **kwargs):
        self.workspace, self.layout, self.kwargs = workspace, layout, kwargs
        self.plans: list[dict] = []
        self.calls.append(self)

    def plan(self, *args, **kwargs):
        names = self.PLAN_ARGS[: len(args)]
        plan = dict(zip(names, args), **kwargs)
        if self.kwargs.get("use_cuda_graph"):
            last_page_len, indices = (self.kwargs[name] for name in self.GRAPH_BUFFERS)
            assert len(plan["last_page_len"]) == len(last_page_len), (
                "a CUDA-graph wrapper is planned at its own batch size"
            )
            assert len(plan["indices"]) <= len(indices), "indices overflow the buffer"
        self.plans.append(plan)

    def run(self, q, cache):
        """Attention of each request's rows over its pages as the last plan describes them (HND pages)."""
        p = self.plans[-1]
        indptr, indices, last = p["indptr"].tolist(), p["indices"].tolist(), p["last_page_len"].tolist()
        qo = p.get("qo_indptr", torch.arange(len(last) + 1)).tolist()
        k_pages, v_pages = cache
        page_size = k_pages.shape[2]
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[indptr[i] : indptr[i + 1]]
            seq = (len(pages) - 1) * page_size + last[i]
            k = k_pages[pages].transpose(1, 2).reshape(-1, k_pages.shape[1], k_pages.shape[3])[:seq]
            v = v_pages[pages].transpose(1, 2).reshape(-1, v_pages.shape[1], v_pages.shape[3])[:seq]
            qi = q[qo[i] : qo[i + 1]].transpose(0, 1)[None]
            n = qi.shape[2]
            mask = torch.arange(seq)[None, :] <= torch.arange(seq - n, seq)[:, None]
            oi = F.scaled_dot_product_attention(
                qi,
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                scale=p["sm_scale"],
                enable_gqa=True,
            )
            out[qo[i] : qo[i + 1]] = oi[0].transpose(0, 1)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    calls: list = []
    PLAN_ARGS = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
    GRAPH_BUFFERS = ("paged_kv_last_page_len_buffer", "paged_kv_indices_buffer")  # FlashInfer's keyword names


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    calls: list = []
    PLAN_ARGS = (
        "qo_indptr",
        "indptr",
        "indices",
        "last_page_len",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "page_size",
    )
    GRAPH_BUFFERS = ("paged_kv_last_page_len_buf", "paged_kv_indices_buf")


def install(monkeypatch) -> types.ModuleType:
    """Put the fake in sys.modules (as `flashinfer`) for one test; its wrappers' call lists start empty."""
    module = types.ModuleType("flashinfer")
    for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        monkeypatch.setattr(cls, "calls", [])
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module
