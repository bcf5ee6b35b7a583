"""The prefill attention kernel choices for the MHA form of MLA on one GPU, one layer's shapes.

    python3 bench/prefill_attention.py [--heads 16]

Shapes: DeepSeek's MHA form, q/k head dim 192 (128 nope + 64 rope), v head dim 128, bf16.
Batches (q_lens over kv_lens): one fresh 2048 / 8192 prompt, 8 fresh 2048 prompts, and a 2048
chunk over a 6144-token cached prefix. Candidates:

- fa2_varlen: torch.nn.attention.varlen.varlen_attn (aten FA2), one launch, v as given;
- fa2_varlen_padv: the same with v zero-padded to 192;
- sdpa_cudnn / sdpa_flash / sdpa_efficient: F.scaled_dot_product_attention per sequence on
  [1, H, L, D] with is_causal (top-left causal: valid only where q_len == kv_len, so the
  prefix case is skipped for them);
- upproj: the rest of the MHA-form path at that size (gather + dequant of the fp8 latent,
  up-projection to K/V), for scale.

Each is checked against an fp32 reference on the first sequence (rel err printed) and timed
(median of CUDA-event timings). TFLOP/s counts the causal FLOPs actually needed (QK 192 + PV 128).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics

import torch
import torch.nn.functional as F

D_QK, D_V = 192, 128


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def flops(q_lens, kv_lens, heads) -> float:
    pairs = sum(q * (k - q) + q * (q + 1) / 2 for q, k in zip(q_lens, kv_lens))
    return 2 * pairs * heads * (D_QK + D_V)


def reference(q, k, v, scale):
    """fp32, bottom-right causal. q [q, H, D], k [L, H, D], v [L, H, Dv]."""
    ql, kl = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    mask = (
        torch.arange(kl, device=q.device)[None]
        > torch.arange(kl - ql, kl, device=q.device)[:, None]
    )
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khv->qhv", p, v.float())


def bench_shape(name, q_lens, kv_lens, h, causal, params, rows) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    dev, dt, scale = torch.device("cuda"), torch.bfloat16, D_QK**-0.5
    T, S = sum(q_lens), sum(kv_lens)
    q = torch.randn(T, h, D_QK, device=dev, dtype=dt)
    k = torch.randn(S, h, D_QK, device=dev, dtype=dt)
    v = torch.randn(S, h, D_V, device=dev, dtype=dt)
    cu_q = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )
    cu_k = torch.tensor(
        [0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )
    ref = reference(q[: q_lens[0]], k[: kv_lens[0]], v[: kv_lens[0]], scale)
    fl = flops(q_lens, kv_lens, h)
    fresh = q_lens == kv_lens

    def fa2(vv):
        kw = dict(causal)
        if "scale" in params:
            kw["scale"] = scale
        return lambda: varlen_attn(q, k, vv, cu_q, cu_k, max(q_lens), max(kv_lens), **kw)

    vpad = torch.cat([v, v.new_zeros(S, h, D_QK - D_V)], -1)
    cands = {"fa2_varlen": fa2(v), "fa2_varlen_padv": fa2(vpad)}
    for bname, backend in (
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        if not fresh:
            continue

        def per_seq(backend=backend):
            outs, q0, k0 = [], 0, 0
            with sdpa_kernel([backend]):
                for ql, kl in zip(q_lens, kv_lens):
                    qb = q[q0 : q0 + ql].transpose(0, 1)[None]
                    kb = k[k0 : k0 + kl].transpose(0, 1)[None]
                    vb = v[k0 : k0 + kl].transpose(0, 1)[None]
                    outs.append(
                        F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)[
                            0
                        ].transpose(0, 1)
                    )
                    q0, k0 = q0 + ql, k0 + kl
            return torch.cat(outs)

        cands[bname] = per_seq
    latent = torch.randn(S, 576, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(h * (128 + D_V), 512, device=dev, dtype=dt) * 0.04

    def upproj():
        c = (latent.float() * 0.5).to(dt)
        kv = (c[:, :512] @ w.T).view(S, h, 128 + D_V)
        kk = torch.cat([kv[..., :128], c[:, None, 512:].expand(-1, h, -1)], -1)
        return kk, kv[..., 128:]

    cands["upproj"] = upproj
    for cname, fn in cands.items():
        try:
            out = fn()
            err = None
            if cname != "upproj":
                o = out[: q_lens[0], :, :D_V].float()
                err = float((o - ref).norm() / ref.norm())
            ms = timed(fn)
            row = {
                "shape": name,
                "kernel": cname,
                "ms": ms,
                "rel_err": err,
                "tflops": None if cname == "upproj" else fl / ms / 1e9,
            }
        except Exception as e:  # a candidate that cannot run is a result
            row = {"shape": name, "kernel": cname, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    print("varlen_attn params:", list(params), flush=True)
    h = args.heads
    shapes = {
        "1x2048": ([2048], [2048]),
        "1x8192": ([8192], [8192]),
        "8x2048": ([2048] * 8, [2048] * 8),
        "2048 over 6144": ([2048], [8192]),
    }
    rows = []
    for name, (q_lens, kv_lens) in shapes.items():
        bench_shape(name, q_lens, kv_lens, h, causal, params, rows)
    print(f"\ndevice: {torch.cuda.get_device_name()}  torch {torch.__version__}  heads {h}")
    print(f"{'shape':<16} {'kernel':<16} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<16} {r['kernel']:<16} {r['error']}")
            continue
        tf = "" if r["tflops"] is None else f"{r['tflops']:.0f}"
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"{r['shape']:<16} {r['kernel']:<16} {r['ms']:>8.3f} {tf:>8} {err:>9}")
    print(
        json.dumps(
            {
                "bench": "prefill_attention",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
