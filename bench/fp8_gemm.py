"""FP8 block GEMMs vs bf16 at the shapes of one DeepSeek-V2-Lite layer, on the GPU.

    python3 bench/fp8_gemm.py [--m 1 8 32 64 2048] [--iters 20]

For every M (tokens in the step) and every projection of a V2-Lite layer (hidden 2048, 16
heads, no q_lora; dense MLP 10944; 64 routed experts of 1408, top-6; 2 shared experts):

    bf16    F.linear / torch._grouped_mm on bf16 weights (what the model runs today)
    fp8     block_fp8_linear / grouped_block_fp8_linear as the model runs it: the activation
            quantisation included, the GEMM picked by `gemm_backend`
    triton  the W8A8 Triton block-FP8 GEMM forced (activation quantisation + GEMM; at M <= 64
            the default is the one-launch W8A16 kernel), dense and experts, and
    torch   torch's blockwise F.scaled_mm forced (dense, SM90 only; M >= 16, N, K % 128 == 0)

Timing: each op is captured `--iters` times in one CUDA graph and replayed (GPU time, no launch
overhead), cycling over enough weight copies (>= 256 MB) that no weight is served from L2: a
decode-sized GEMM is then bound by HBM, as in a real step. Floors = weight bytes read / 3.0 TB/s
(the H100's measured copy bandwidth, measurements.md). Routed experts at M tokens read the
experts that M x 6 random picks touch. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from mlaserve.ops.fp8_gemm import block_fp8_linear, gemm_backend
from mlaserve.ops.fp8_grouped_gemm import GROUPED_W8A16_MAX_ROWS, grouped_block_fp8_linear
from mlaserve.ops.fp8_quant import quantize_weight_block

HBM_BYTES_PER_S = 3.0e12
L2_FLUSH_BYTES = 256 << 20
# V2-Lite: name -> (N, K). q_proj: 16 heads x 192; kv_a: 512 + 64; o_proj: 16 x 128.
DENSE = {
    "q_proj": (3072, 2048),
    "kv_a_proj_with_mqa": (576, 2048),
    "o_proj": (2048, 2048),
    "dense_gate_up": (2 * 10944, 2048),
    "dense_down": (2048, 10944),
    "shared_gate_up": (2 * 2816, 2048),
    "shared_down": (2048, 2816),
}
EXPERTS = {"experts_gate_up": (2 * 1408, 2048), "experts_down": (2048, 1408)}
NUM_EXPERTS, TOP_K = 64, 6


def graph_time_us(fn, iters: int) -> float:
    """GPU time per call of fn(i) (i = 0..iters-1), from one captured graph of `iters` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(iters):  # warm-up: compile kernels, settle the allocator
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * iters)


def copies_for(nbytes: int) -> int:
    return max(1, -(-L2_FLUSH_BYTES // max(nbytes, 1)))


def bench_dense(name: str, n: int, k: int, ms: list[int], iters: int) -> list[dict]:
    copies = copies_for(n * k)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w8 = [quantize_weight_block(w) for w in w16]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"op": name, "m": m, "n": n, "k": k}
        row["bf16_us"] = graph_time_us(lambda i, x=x: F.linear(x, w16[i % copies]), iters)
        row["fp8_us"] = graph_time_us(lambda i, x=x: block_fp8_linear(x, *w8[i % copies]), iters)
        row["fp8_gemm"] = gemm_backend(x.device, m, n, k, w8[0][1].shape[0], x.dtype)
        row["triton_us"] = graph_time_us(
            lambda i, x=x: block_fp8_linear(x, *w8[i % copies], backend="triton"), iters
        )
        sm90 = torch.cuda.get_device_capability()[0] == 9
        if sm90 and m >= 16 and n % 128 == 0 and k % 128 == 0:
            try:
                row["torch_us"] = graph_time_us(
                    lambda i, x=x: block_fp8_linear(x, *w8[i % copies], backend="torch_blockwise"),
                    iters,
                )
            except (RuntimeError, ValueError) as e:  # record a rejected shape, keep the run
                row["torch_error"] = str(e).splitlines()[0][:200]
        row["bf16_floor_us"] = 2 * n * k / HBM_BYTES_PER_S * 1e6
        row["fp8_floor_us"] = (n * k + 4 * w8[0][1].numel()) / HBM_BYTES_PER_S * 1e6
        rows.append(row)
    return rows


def bench_experts(name: str, n: int, k: int, ms: list[int], iters: int) -> list[dict]:
    copies = copies_for(NUM_EXPERTS * n * k)
    w16 = [
        torch.randn(NUM_EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for _ in range(copies)
    ]
    w8 = [quantize_weight_block(w) for w in w16]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in ms:
        pairs = m * TOP_K
        ids = torch.stack(
            [torch.randperm(NUM_EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(m)]
        ).reshape(-1)
        ids = ids.sort().values
        counts = torch.bincount(ids, minlength=NUM_EXPERTS).to(torch.int32)
        offs = counts.cumsum(0, dtype=torch.int32)
        touched = int((counts > 0).sum())
        x = torch.randn(pairs, k, device="cuda", dtype=torch.bfloat16)
        row = {"op": name, "m": m, "n": n, "k": k, "experts_touched": touched}
        row["bf16_us"] = graph_time_us(
            lambda i, x=x, offs=offs: torch._grouped_mm(
                x, w16[i % copies].transpose(1, 2), offs=offs
            ),
            iters,
        )
        row["fp8_us"] = graph_time_us(
            lambda i, x=x, c=counts: grouped_block_fp8_linear(x, c, *w8[i % copies]), iters
        )
        row["fp8_gemm"] = "triton_grouped_" + (
            "w8a16" if pairs <= GROUPED_W8A16_MAX_ROWS else "w8a8"
        )
        row["triton_us"] = graph_time_us(  # the W8A8 form forced (activation quantisation)
            lambda i, x=x, c=counts: grouped_block_fp8_linear(x, c, *w8[i % copies], w8a16=False),
            iters,
        )
        row["bf16_floor_us"] = 2 * touched * n * k / HBM_BYTES_PER_S * 1e6
        row["fp8_floor_us"] = touched * n * k * (1 + 4 / 128**2) / HBM_BYTES_PER_S * 1e6
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64, 2048])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_gemm.py needs a CUDA GPU")
    rows: list[dict] = []
    for name, (n, k) in DENSE.items():
        rows += bench_dense(name, n, k, args.m, args.iters)
        torch.cuda.empty_cache()
    for name, (n, k) in EXPERTS.items():
        rows += bench_experts(name, n, k, args.m, args.iters)
        torch.cuda.empty_cache()

    def us(row: dict, key: str) -> str:
        return f"{row[key]:8.1f}" if key in row else "       -"

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = "op                   M      N      K   bf16_us   fp8_us fp8/bf16 triton_us torch_us"
    print(header + " bf16_floor fp8_floor fp8_gemm")
    for r in rows:
        ratio = r["fp8_us"] / r["bf16_us"]
        print(
            f"{r['op']:<18} {r['m']:>4} {r['n']:>6} {r['k']:>6}  {r['bf16_us']:8.1f} "
            f"{r['fp8_us']:8.1f} {ratio:8.2f} {us(r, 'triton_us')}  {us(r, 'torch_us')}"
            f"   {r['bf16_floor_us']:8.1f}  {r['fp8_floor_us']:8.1f} {r['fp8_gemm']}"
        )
    for m in args.m:  # one layer's GEMMs at this M (dense MLP and MoE both listed)
        sel = [r for r in rows if r["m"] == m]
        bf16, fp8 = sum(r["bf16_us"] for r in sel), sum(r["fp8_us"] for r in sel)
        print(f"M={m:<5} all ops: bf16 {bf16:8.1f} us, fp8 {fp8:8.1f} us, ratio {fp8 / bf16:.2f}")
    print(json.dumps({"bench": "fp8_gemm", "device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
