"""MLA decode attention at small batches: the Triton split-KV kernel + combine
(`mlaserve/ops/mla_decode.py`, PDL launches) vs FlashMLA's legacy SM90 decode, as the flashmla
backend calls it (`mlaserve/kernels_adapter/flashmla.py`).

    python3 bench/mla_decode.py [--bs 1 2 4 8 16 32] [--q-len 1 4] [--ctx 1024 4096]
                                [--kv fp8 bf16] [--heads 16] [--layers 27]
    python3 bench/mla_decode.py --sweep --bs 1 8 --q-len 1 --ctx 1024 --kv fp8   # tiles

Per (kv dtype, bs, q_len, ctx), every sequence at ctx keys (q_len of them new), H heads
(V2-Lite's 16 by default; --heads 128 for V3), r 512, d_r 64, page 64, bf16 queries, a
shuffled page table. Each "layer" reads its own KV buffer (as in the model: nothing stays in
L2 from one call to the next). Columns, in GPU microseconds per layer (one CUDA graph replaying
the chain of --layers calls; median of --reps replays / layers; launch gaps count as in the
model):

    triton    mla_decode (split kernel, + combine when splits > 1)
    fmla      what the backend runs per layer: q cat + cast (`ops/q_prep.py`; fp8 q for an fp8
              cache) + flash_mla_with_kvcache; its schedule (get_mla_decoding_metadata) once per
              chain, as once per forward
    fmla_k    flash_mla_with_kvcache alone (q prepared outside the graph) + the schedule
    floor     KV bytes / the device copy bandwidth measured in this run

and errors on layer 0 against an fp32 reference (gathered KV, explicit causal mask): err_tri,
err_fm (FlashMLA's fp8 path also quantises q to e4m3, so its error includes that), and
|tri - fm| their max abs difference. Without flash_mla (or off SM90) only the Triton columns
print.

--sweep times MlaDecodeConfig tiles (`sweep_configs`: max_block_m x block_n x warps x min
chunk x programs per SM) for the Triton pair only and prints the best per shape next to the
default. Each tile is a compile (~1-2 s) and a graph capture, 48 of them per (kv dtype, q_len
bucket): sweep a few shapes per run. Some of them spill registers (the compile test's note in
`MlaDecodeConfig`): they run, slower.

`MLASERVE_PDL=0` runs the Triton pair without PDL (an A/B of the early launch).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import copy_bandwidth
from fusions import graph_time_us

from mlaserve.ops.mla_decode import (
    MlaDecodeConfig,
    MlaDecodeWorkspace,
    choose_num_splits,
    mla_decode,
)

RANK, ROPE, PAGE = 512, 64, 64
SCALE = 1.0 / math.sqrt(128 + ROPE)
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def load_flash_mla():
    """The flash_mla module when this machine can run its legacy SM90 kernels, else None."""
    if torch.cuda.get_device_capability() != (9, 0):
        return None
    try:
        import flash_mla
    except ImportError:
        return None
    return flash_mla if flash_mla.has_legacy() else None


def replay_us(chain: Callable[[], object], calls: int, reps: int) -> tuple[float, object]:
    """GPU microseconds per call of a chain of `calls` calls, captured once in a CUDA graph
    (`fusions.graph_time_us`): median over `reps` replays / calls. Also returns the captured
    outputs (the graph's last replay wrote them)."""
    captured = {}

    def run() -> None:
        captured["out"] = chain()  # the capture's call is the last one: its outputs stay

    return graph_time_us(run, 1, reps) / calls, captured["out"]


class Pool:
    """--layers KV buffers [num_pages, 64, 576] of one dtype, random values, for up to max_bs
    sequences of max_ctx keys each; one shuffled page table shared by the layers."""

    def __init__(self, kv_dtype, layers, max_bs, max_ctx, k_scale, device) -> None:
        per_seq = -(-max_ctx // PAGE)
        num_pages = max_bs * per_seq + 1  # page 0 reserved, as in the pool
        g = torch.Generator(device=device).manual_seed(0)
        self.fp8 = kv_dtype == torch.float8_e4m3fn
        self.scale = k_scale if self.fp8 else 1.0  # value = stored * scale
        self.k_scale = torch.full((1,), self.scale, dtype=torch.float32, device=device)
        self.caches = []
        for _ in range(layers):
            kv = torch.empty(num_pages, PAGE, RANK + ROPE, dtype=kv_dtype, device=device)
            for p0 in range(0, num_pages, 1024):  # in slices: no fp32 copy of the whole pool
                part = torch.randn(kv[p0 : p0 + 1024].shape, device=device, generator=g)
                kv[p0 : p0 + 1024] = (part / self.scale).to(kv_dtype)  # values N(0, 1)
            self.caches.append(kv)
        perm = torch.randperm(num_pages - 1, device=device, generator=g) + 1
        self.block_tables = perm[: max_bs * per_seq].view(max_bs, per_seq).to(torch.int32)
        self.kv_dtype = kv_dtype

    def kv_bytes(self, bs: int, ctx: int) -> int:
        return bs * ctx * (RANK + ROPE) * self.caches[0].element_size()


def reference(q_nope, q_pe, kv, scale, block_tables, ctx, q_len) -> torch.Tensor:
    """fp32 [T, H, r] over the first ctx keys of each sequence, causal among the new ones."""
    num_tokens, heads, _ = q_nope.shape
    bs = num_tokens // q_len
    pages = block_tables.long()
    if kv.element_size() == 1:  # fp8: gather the bytes (no float8 indexing kernels needed)
        keys = kv.view(torch.uint8)[pages].view(kv.dtype)
    else:
        keys = kv[pages]
    keys = keys.float().flatten(1, 2)[:, :ctx] * scale  # [bs, ctx, 576]
    q = torch.cat([q_nope, q_pe], dim=-1).float().view(bs, q_len, heads, -1)
    s = torch.einsum("bqhd,bnd->bqhn", q, keys) * SCALE
    last = ctx - q_len + torch.arange(q_len, device=q.device)
    s = s.masked_fill(torch.arange(ctx, device=q.device) > last[:, None, None], float("-inf"))
    out = torch.einsum("bqhn,bnc->bqhc", torch.softmax(s, dim=-1), keys[..., :RANK])
    return out.reshape(num_tokens, heads, RANK)


def flash_mla_chain(fm, pool, q_nope, q_pe, block_tables, seq_lens, q_len, prepared):
    """The backend's decode calls for every layer. `prepared`: q built once outside (kernel
    only), else per layer as the backend does."""
    num_tokens, heads, _ = q_nope.shape
    bs = num_tokens // q_len
    q_dtype = torch.float8_e4m3fn if pool.fp8 else torch.bfloat16
    ones = torch.ones(1, dtype=torch.float32, device=q_nope.device)
    extra = {"descale_q": ones, "descale_k": pool.k_scale} if pool.fp8 else {}
    try:
        from mlaserve.ops.q_prep import prepare_q
    except ImportError:
        prepare_q = None

    def make_q():
        if prepare_q is not None:
            return prepare_q(q_nope, q_pe, q_dtype)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return (q.clamp(-448, 448) if pool.fp8 else q).to(q_dtype)

    fixed_q = make_q() if prepared else None

    def chain():
        sched, _ = fm.get_mla_metadata()
        sched.tile_scheduler_metadata, sched.num_splits = fm.get_mla_decoding_metadata(
            seq_lens, q_len * heads, 1, is_fp8_kvcache=pool.fp8, use_legacy=True
        )
        outs = []
        for kv in pool.caches:
            q = fixed_q if prepared else make_q()
            out, _ = fm.flash_mla_with_kvcache(
                q.view(bs, q_len, heads, -1), kv.unsqueeze(2), block_tables, seq_lens,
                head_dim_v=RANK, tile_scheduler_metadata=sched, softmax_scale=SCALE,
                causal=True, is_fp8_kvcache=pool.fp8, use_legacy=True, **extra,
            )  # fmt: skip
            outs.append(out)
        return outs[0].reshape(num_tokens, heads, RANK)

    return chain


def triton_chain(pool, q_nope, q_pe, block_tables, seq_lens, q_len, workspace, config):
    def chain():
        outs = []
        for kv in pool.caches:
            out = mla_decode(
                q_nope, q_pe, kv, pool.k_scale, block_tables, seq_lens, q_len, SCALE,
                workspace=workspace, config=config,
            )  # fmt: skip
            outs.append(out)
        return outs[0]

    return chain


def sweep_configs() -> list[MlaDecodeConfig]:
    """max_block_m x block_n x warps x min chunk x programs per SM (48 tiles; num_stages is
    left out: Triton does not pipeline the key loop, so it changes nothing)."""
    grid = itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2), (1, 2))
    return [
        MlaDecodeConfig(
            max_block_m=m,
            block_n=n,
            wide_block_n=n,  # one key step at every row count: the tile is what is swept
            num_warps=w,
            min_chunk_blocks=c,
            programs_per_sm=p,
        )
        for m, n, w, c, p in grid
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--q-len", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--kv", nargs="+", choices=list(KV_DTYPES), default=["fp8", "bf16"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--k-scale", type=float, default=0.5, help="the fp8 cache's scale")
    ap.add_argument("--sweep", action="store_true", help="time MlaDecodeConfig tiles instead")
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = copy_bandwidth(device)
    fm = None if args.sweep else load_flash_mla()
    have_fm = "yes" if fm else "no"
    print(f"device: {torch.cuda.get_device_name()}  SMs {sms}  copy BW {bw / 1e12:.2f} TB/s  "
          f"heads {args.heads}  layers {args.layers}  flash_mla {have_fm}")  # fmt: skip
    if args.sweep:
        print("kv    bs  q ctx   default us  best us  best config")
    else:
        print("kv    bs  q   ctx splits triton   fmla fmla_k  floor fm/tri  err_tri  err_fm "
              "|tri-fm|")  # fmt: skip
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    for kv_name in args.kv:
        pool = Pool(KV_DTYPES[kv_name], args.layers, max(args.bs), max(args.ctx),
                    args.k_scale, device)  # fmt: skip
        workspace = MlaDecodeWorkspace(max(args.bs), max(args.q_len), args.heads, RANK, device)
        for bs, q_len, ctx in itertools.product(args.bs, args.q_len, args.ctx):
            t = bs * q_len
            q_nope = torch.randn(t, args.heads, RANK, device=device, generator=g).to(torch.bfloat16)
            q_pe = torch.randn(t, args.heads, ROPE, device=device, generator=g).to(torch.bfloat16)
            block_tables = pool.block_tables[:bs, : -(-ctx // PAGE)].contiguous()
            seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
            inputs = (pool, q_nope, q_pe, block_tables, seq_lens, q_len)
            floor = pool.kv_bytes(bs, ctx) / bw * 1e6
            if args.sweep:
                default_us, _ = replay_us(
                    triton_chain(*inputs, workspace, MlaDecodeConfig()), args.layers, args.reps
                )
                best = (float("inf"), None)
                for cfg in sweep_configs():
                    ws = MlaDecodeWorkspace(bs, q_len, args.heads, RANK, device, config=cfg)
                    try:
                        us, _ = replay_us(triton_chain(*inputs, ws, cfg), args.layers, args.reps)
                    except Exception as e:  # a tile that does not fit (shared memory)
                        print(f"  skip {cfg}: {type(e).__name__}")
                        continue
                    best = min(best, (us, cfg), key=lambda x: x[0])
                print(f"{kv_name:5} {bs:3d} {q_len:2d} {ctx:5d} {default_us:9.2f} "
                      f"{best[0]:8.2f}  {best[1]}")  # fmt: skip
                rows.append({"kv": kv_name, "bs": bs, "q_len": q_len, "ctx": ctx,
                             "default_us": default_us, "best_us": best[0],
                             "best_config": repr(best[1])})  # fmt: skip
                continue
            splits = choose_num_splits(bs, q_len, args.heads, sms)
            tri_us, tri_out = replay_us(
                triton_chain(*inputs, workspace, MlaDecodeConfig()), args.layers, args.reps
            )
            ref = reference(q_nope, q_pe, pool.caches[0], pool.scale, block_tables, ctx, q_len)
            row = {"kv": kv_name, "bs": bs, "q_len": q_len, "ctx": ctx, "splits": splits,
                   "triton_us": tri_us, "floor_us": floor,
                   "err_triton": (tri_out.float() - ref).abs().max().item()}  # fmt: skip
            line = f"{kv_name:5} {bs:3d} {q_len:2d} {ctx:5d} {splits:6d} {tri_us:6.2f}"
            if fm is not None:
                fm_us, fm_out = replay_us(flash_mla_chain(fm, *inputs, False), args.layers,
                                          args.reps)  # fmt: skip
                fmk_us, _ = replay_us(flash_mla_chain(fm, *inputs, True), args.layers, args.reps)
                fm_err = (fm_out.float() - ref).abs().max().item()
                diff = (fm_out.float() - tri_out.float()).abs().max().item()
                row |= {"fmla_us": fm_us, "fmla_kernel_us": fmk_us, "err_fmla": fm_err,
                        "max_abs_diff": diff}  # fmt: skip
                line += (f" {fm_us:6.2f} {fmk_us:6.2f} {floor:6.2f} {fm_us / tri_us:6.2f} "
                         f"{row['err_triton']:8.4f} {row['err_fmla']:7.4f} "
                         f"{row['max_abs_diff']:8.4f}")  # fmt: skip
            else:
                line += f" {'-':>6} {'-':>6} {floor:6.2f} {'-':>6} {row['err_triton']:8.4f}"
            print(line)
            rows.append(row)
        del pool, workspace
        torch.cuda.empty_cache()
    print(json.dumps({"bench": "mla_decode", "device": torch.cuda.get_device_name(),
                      "heads": args.heads, "layers": args.layers, "sweep": args.sweep,
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
