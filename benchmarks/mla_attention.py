"""MLA attention on the CPU: absorbed weights (what common.model.mla does) against decompressing the
latent into per-head K and V on the fly, at DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank
512, rope 64, no-rope 128, v 128), float32.

    decode : B requests x 1 new token over S cached tokens each
    prefill: one request of S tokens, causal

Both variants start from the latent cache [S, 512 + 64] a pool read returns and end at the heads'
outputs [T, H, v]; the outputs are checked equal (to float32 rounding) before timing.

    PYTHONPATH=. .venv/bin/python benchmarks/mla_attention.py [--context 1024 4096] [--batch 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, R, ROPE, NOPE, V = 16, 512, 64, 128, 128
SCALE = (NOPE + ROPE) ** -0.5


def absorbed(q_nope, q_pe, cache, w_uk, w_uv, causal, fold=True):
    """q_*: [B, T, H, *]; cache: [B, S, R + ROPE]. MQA over the latent, V = the latent; `fold`: the heads
    as query rows (common.attention.torch_backend), else SDPA's GQA path."""
    b, t = q_nope.shape[:2]
    s = cache.shape[1]
    q = torch.cat((torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q_pe), dim=-1).transpose(1, 2)  # [B, H, T, D]
    kv = cache[:, None]  # [B, 1, S, R + ROPE]
    if not fold:
        out = F.scaled_dot_product_attention(q, kv, kv[..., :R], is_causal=causal, scale=SCALE, enable_gqa=True)
        return torch.einsum("bhtr,hvr->bthv", out, w_uv)
    mask = (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]).repeat(H, 1) if causal else None
    out = F.scaled_dot_product_attention(q.reshape(b, 1, H * t, -1), kv, kv[..., :R], attn_mask=mask, scale=SCALE)
    return torch.einsum("bhtr,hvr->bthv", out.view(b, H, t, R), w_uv)


def absorbed_gqa(*args):
    return absorbed(*args, fold=False)


def decompressed(q_nope, q_pe, cache, w_uk, w_uv, causal):
    """Every cached token's latent up-projected to H keys and values, then plain MHA."""
    b, s = cache.shape[:2]
    latent, k_pe = cache[..., :R], cache[..., R:]
    k_nope = torch.einsum("bsr,hnr->bhsn", latent, w_uk)
    v = torch.einsum("bsr,hvr->bhsv", latent, w_uv)
    k = torch.cat((k_nope, k_pe[:, None].expand(b, H, s, ROPE)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE)
    return out.transpose(1, 2)


def timed(fn, *args, repeat: int = 3) -> float:
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - start) / repeat * 1000


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = torch.randn(H, NOPE, R, generator=g) * 0.05, torch.randn(H, V, R, generator=g) * 0.05
    print(f"torch threads: {torch.get_num_threads()}")
    print("| case | context | absorbed ms | absorbed, SDPA GQA ms | decompressed ms | decompressed / absorbed |")
    print("|---|---|---|---|---|---|")
    for s in args.context:
        for case, b, t in (("decode", args.batch, 1), ("prefill", 1, s)):
            q_nope, q_pe = torch.randn(b, t, H, NOPE, generator=g), torch.randn(b, t, H, ROPE, generator=g)
            cache = torch.randn(b, s, R + ROPE, generator=g)
            inputs = (q_nope, q_pe, cache, w_uk, w_uv, t > 1)
            assert torch.allclose(absorbed(*inputs), decompressed(*inputs), rtol=1e-3, atol=1e-4)
            assert torch.allclose(absorbed_gqa(*inputs), decompressed(*inputs), rtol=1e-3, atol=1e-4)
            a, gqa, d = timed(absorbed, *inputs), timed(absorbed_gqa, *inputs), timed(decompressed, *inputs)
            print(f"| {case} (B={b}) | {s} | {a:.1f} | {gqa:.1f} | {d:.1f} | {d / a:.2f}x |")


if __name__ == "__main__":
    main()
