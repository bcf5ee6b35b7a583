"""Trains mlaserve's embedded default model: a small DeepSeek-V3 (10 decoder layers, the first
dense, the rest MoE with a shared expert) with one MTP module trained jointly, on the Python
standard library of the interpreter that runs this script.

Everything is derived from `--seed` and the stdlib tree: the held-out split (a hash of each
file's path), the BPE tokenizer, the initial weights and the batch order. Run on one GPU, from
the repository root:

    python tools/train_default_model.py --out /tmp/dm \
        --heldout-out /tmp/dm-heldout.jsonl.gz --log-json $OUT/train_log.json

With no `--steps`, the step count is the smaller of `--max-epochs` over the training tokens and
what fits in `--train-seconds` (and in what `--time-budget-s` leaves) at the step time measured
on a throwaway copy of the model; the log prints it, and `--steps N` replays that run.

`--time-budget-s` bounds the whole script: training stops early (and the run is saved as it is)
when only `--save-reserve-s` are left, and the post-training checks are skipped when they would
not fit. The output folder is written before those checks, so a failure there loses nothing;
`--log-json` is rewritten after every progress evaluation, so even a crash leaves the curve.
`--sizes-only` prints the parameter count and checkpoint bytes of the architecture and exits.

Throughput (v2's first H100 run: 83k tokens/s, so 1076 of 1577 planned steps fit and held-out
perplexity ended at 18.6 while still falling): the experts run as transformers' grouped GEMM on
CUDA instead of its loop over experts (which reads each expert's token list back to the host),
and the first 3/4 of the steps train on 1024-token windows (attention per token a quarter of
4096's), the last 1/4 on 4096-token windows so that max_position_embeddings stays trained.
Neither has run on a GPU yet (no device time in the session that wrote it): the run log's
`plan.step_seconds_per_seq_len` will say what they buy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from default_model_common import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    FP32_SUFFIXES,
    PAD_TOKEN,
    SAMPLE_PROMPTS,
    SPECIAL_TOKENS,
    DeepseekV3MTPLayer,
    Document,
    evaluate,
    forward_main_and_mtp,
    load_mtp_layer,
    make_config,
    pack_documents,
    read_corpus,
    save_checkpoint,
    split_experts,
    split_windows,
    stdlib_root,
    subsample,
    write_documents,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from transformers import (
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("mlaserve/assets/default-model"))
    p.add_argument(
        "--heldout-out", type=Path, default=Path("tools/data/default_model_heldout.jsonl.gz")
    )
    p.add_argument("--log-json", type=Path, default=None, help="loss curve, evals, samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    # 4096-token windows: max_position_embeddings is what was trained, not an extrapolation.
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8, help="windows per step (32,768 tokens)")
    p.add_argument(
        "--short-seq-len",
        type=int,
        default=1024,
        help="window length of the first (1 - --long-fraction) of the steps, with as many more "
        "windows per step as keep the tokens per step (attention per token is 4x cheaper at "
        "1024 than at 4096, so more tokens fit the time budget); 0: --seq-len throughout",
    )
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.25,
        help="the last fraction of the steps trains on --seq-len windows, so the positions up "
        "to max_position_embeddings are trained (context extension at the end, as usual)",
    )
    p.add_argument(
        "--experts-implementation",
        choices=("eager", "grouped_mm", "batched_mm"),
        default=None,
        help="transformers' MoE experts forward: default grouped_mm on CUDA (one grouped GEMM "
        "per projection, no host sync), eager (a loop over experts) elsewhere",
    )
    p.add_argument(
        "--eval-seq-len",
        type=int,
        default=1024,
        help="held-out window length, as tools/eval_default_model.py (and the v1 card) use",
    )
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument(
        "--bias-update-speed",
        type=float,
        default=1e-2,
        help="DeepSeek-V3's auxiliary-loss-free balancing step for e_score_correction_bias "
        "(V3 used 1e-3 over far more steps)",
    )
    p.add_argument("--steps", type=int, default=None, help="fixed step count (skips timing)")
    p.add_argument(
        "--max-epochs",
        type=float,
        default=12.0,
        help="v1 (2 layers) was best on held-out text at epoch ~15 of a 25-epoch cosine run and "
        "worse at its end; a deeper model fits the 3M training tokens sooner",
    )
    p.add_argument("--train-seconds", type=float, default=420.0, help="training-loop target")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=540.0,
        help="hard bound on the whole script's wall time (start-up to checkpoint and log)",
    )
    p.add_argument(
        "--save-reserve-s",
        type=float,
        default=30.0,
        help="seconds kept for saving when the time budget stops training",
    )
    p.add_argument(
        "--eval-windows", type=int, default=32, help="held-out windows per progress eval"
    )
    p.add_argument("--evals", type=int, default=8, help="progress evals during training")
    p.add_argument("--device", default=None)
    p.add_argument("--max-files", type=int, default=None, help="corpus cap, for dry runs only")
    p.add_argument("--sizes-only", action="store_true", help="print the model's sizes and exit")
    return p.parse_args()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[Document], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every byte sequence round-trips, and runs of indentation become single tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prompts get <bos> like DeepSeek's tokenizer gives them (and like training documents start).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path, max_length: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode(tokenizer: Tokenizer, docs: list[Document]) -> torch.Tensor:
    encodings = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    return pack_documents(
        [e.ids for e in encodings],
        tokenizer.token_to_id(BOS_TOKEN),
        tokenizer.token_to_id(EOS_TOKEN),
    )


# ----------------------------------------------------------------------------------------------
# Model and training
# ----------------------------------------------------------------------------------------------


def build_model(
    config: DeepseekV3Config, device: torch.device
) -> tuple[DeepseekV3ForCausalLM, DeepseekV3MTPLayer]:
    """Main model plus an MTP module sharing its embedding and lm head, all in fp32 (bf16 only
    under autocast) and initialised the way transformers initialises DeepSeek-V3."""
    model = DeepseekV3ForCausalLM(config)
    mtp = DeepseekV3MTPLayer(model.config, model.model.embed_tokens, model.lm_head)
    shared = {id(model.model.embed_tokens), id(model.lm_head)}
    for module in mtp.modules():
        if id(module) not in shared:
            model._init_weights(module)
    return model.to(device).train(), mtp.to(device).train()


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay matrices (embeddings, projections, expert stacks), not norm gains; shared
    parameters (the MTP's embedding and head) are listed once."""
    seen: set[int] = set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class ExpertLoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every router's
    `e_score_correction_bias` moves by `speed` towards under-loaded experts (up) and away from
    over-loaded ones (down). The bias only affects which experts are chosen, not their weights."""

    def __init__(self, modules: list[nn.Module], speed: float) -> None:
        self.speed = speed
        self.routers = [
            m for mod in modules for m in mod.modules() if isinstance(m, DeepseekV3TopkRouter)
        ]
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> None:
            if module.training:
                topk_indices = output[2]
                counts.add_(torch.bincount(topk_indices.flatten(), minlength=counts.numel()))

        return hook

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Updates the biases; returns each router's max load over mean load for the step."""
        imbalance = []
        for router, counts in zip(self.routers, self.counts, strict=True):
            mean = counts.mean()
            router.e_score_correction_bias.add_(self.speed * torch.sign(mean - counts))
            imbalance.append(counts.max() / mean.clamp(min=1))
            counts.zero_()
        return torch.stack(imbalance)


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio * peak` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup - 1)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    def __init__(
        self,
        config: DeepseekV3Config,
        device: torch.device,
        args: argparse.Namespace,
        stream: torch.Tensor,
    ) -> None:
        self.args = args
        self.device = device
        self.model, self.mtp = build_model(config, device)
        modules: list[nn.Module] = [self.model, self.mtp]
        self.optimizer = torch.optim.AdamW(
            param_groups(modules, args.weight_decay),
            lr=args.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=device.type == "cuda",
        )
        self.balancer = ExpertLoadBalancer(modules, args.bias_update_speed)
        self.stream = stream.to(device)
        self.offsets = torch.arange(args.seq_len + 1, device=device)
        self.generator = torch.Generator().manual_seed(args.seed + 1)

    def batch(self, seq_len: int) -> torch.Tensor:
        """Random windows of seq_len + 1 tokens, batch_size * --seq-len tokens in all (the batch
        order depends only on the seed)."""
        high = self.stream.numel() - seq_len - 1
        n = max(1, self.args.batch_size * self.args.seq_len // seq_len)
        starts = torch.randint(0, high, (n,), generator=self.generator)
        return self.stream[starts.to(self.device)[:, None] + self.offsets[None, : seq_len + 1]]

    def step(self, lr: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step on windows of `seq_len`; returns (loss, mtp_loss, expert
        imbalance) as device tensors so that nothing waits for the GPU unless the caller logs
        them."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        window = self.batch(seq_len)
        autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"
        )
        with autocast:
            logits, mtp_logits = forward_main_and_mtp(self.model, self.mtp, window[:, :-1])
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits.float().view(-1, vocab), window[:, 1:].reshape(-1))
        mtp_loss = F.cross_entropy(mtp_logits.float().view(-1, vocab), window[:, 2:].reshape(-1))
        # The MTP loss also flows into the main model through h_i, as in DeepSeek-V3.
        (loss + self.args.mtp_weight * mtp_loss).backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), mtp_loss.detach(), self.balancer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def short_seq_len(args: argparse.Namespace) -> int:
    """The first phase's window length (--seq-len when there is no short phase)."""
    short = args.short_seq_len
    return short if 0 < short < args.seq_len and args.long_fraction < 1 else args.seq_len


def seq_len_at(step: int, steps: int, args: argparse.Namespace) -> int:
    """Windows of the short length first, --seq-len for the last --long-fraction of steps."""
    return short_seq_len(args) if step < round(steps * (1 - args.long_fraction)) else args.seq_len


def measure_step_seconds(
    config: DeepseekV3Config,
    device: torch.device,
    args: argparse.Namespace,
    stream: torch.Tensor,
) -> dict[int, float]:
    """Seconds per training step per window length used, timed on a throwaway model so the real
    run's RNG streams are untouched."""
    trainer = Trainer(config, device, args, stream)
    seconds: dict[int, float] = {}
    for seq_len in sorted({short_seq_len(args), args.seq_len}):
        for _ in range(3):  # warm-up: kernel selection, allocator growth
            trainer.step(args.lr * 0.01, seq_len)
        synchronize(device)
        start = time.perf_counter()
        timed = 8
        for _ in range(timed):
            trainer.step(args.lr * 0.01, seq_len)
        synchronize(device)
        seconds[seq_len] = (time.perf_counter() - start) / timed
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def seconds_left(args: argparse.Namespace) -> float:
    """What `--time-budget-s` leaves of the whole script's wall time."""
    return args.time_budget_s - (time.perf_counter() - _T0)


class RunLog:
    """The JSON record of a run (`--log-json`): settings, sizes, the loss curve, progress evals,
    final metrics and samples. Rewritten whole at each checkpoint of progress (atomically, via a
    temporary file), so whatever stops the run, the file on disk is complete JSON."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"status": "running", "curve": [], "evals": []}

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


def plan_steps(
    config: DeepseekV3Config,
    device: torch.device,
    args: argparse.Namespace,
    stream: torch.Tensor,
    run_log: RunLog,
) -> int:
    tokens_per_step = args.batch_size * args.seq_len
    by_epochs = math.ceil(args.max_epochs * stream.numel() / tokens_per_step)
    per_len = measure_step_seconds(config, device, args, stream)
    long_share = args.long_fraction if short_seq_len(args) < args.seq_len else 1.0
    step_seconds = (1 - long_share) * per_len[short_seq_len(args)] + long_share * per_len[
        args.seq_len
    ]
    log(
        "step time per window length: "
        + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in per_len.items())
    )
    # The loop may use what the budget leaves after the save reserve, and 10% of that (or of
    # --train-seconds) goes to progress evals and logging.
    train_seconds = min(args.train_seconds, seconds_left(args) - args.save_reserve_s)
    by_time = int(0.9 * train_seconds / step_seconds)
    steps = max(1, min(by_epochs, by_time))
    log(
        f"step time {step_seconds * 1e3:.1f} ms ({tokens_per_step / step_seconds:,.0f} tok/s); "
        f"steps by epochs {by_epochs}, by time {by_time} ({train_seconds:.0f}s) -> {steps} "
        f"(reproduce with --steps {steps})"
    )
    run_log.data["plan"] = {
        "step_seconds": step_seconds,
        "step_seconds_per_seq_len": per_len,
        "tokens_per_second": tokens_per_step / step_seconds,
        "steps_by_epochs": by_epochs,
        "steps_by_time": by_time,
        "steps": steps,
    }
    return steps


def train(trainer: Trainer, steps: int, heldout: torch.Tensor, run_log: RunLog) -> str:
    """Runs the schedule for `steps` steps; returns why it ended: "completed", "time budget"
    (stopped early, weights kept) or "diverged" (a non-finite loss: weights unusable)."""
    args = trainer.args
    warmup = min(args.warmup_steps, max(1, steps // 10))
    eval_at = {round(steps * (k + 1) / args.evals) - 1 for k in range(args.evals)}
    log_every = max(1, steps // 40)
    tokens_per_step = args.batch_size * args.seq_len
    stop_at = args.time_budget_s - args.save_reserve_s
    synchronize(trainer.device)
    start = time.perf_counter()
    status = "completed"
    for step in range(steps):
        lr = lr_at(step, steps, args.lr, warmup, args.min_lr_ratio)
        loss, mtp_loss, imbalance = trainer.step(lr, seq_len_at(step, steps, args))
        elapsed = time.perf_counter() - start
        if step % log_every == 0 or step == steps - 1:
            # .item() waits for the GPU: only on logged steps.
            loss_value, mtp_value = loss.item(), mtp_loss.item()
            epochs = (step + 1) * tokens_per_step / trainer.stream.numel()
            log(
                f"step {step + 1}/{steps} lr {lr:.2e} loss {loss_value:.4f} "
                f"mtp_loss {mtp_value:.4f} epoch {epochs:.2f} max/mean expert load "
                f"{' '.join(f'{x:.2f}' for x in imbalance.tolist())} "
                f"{(step + 1) * tokens_per_step / elapsed:,.0f} tok/s"
            )
            run_log.data["curve"].append(
                {
                    "step": step + 1,
                    "epoch": round(epochs, 4),
                    "lr": lr,
                    "loss": loss_value,
                    "mtp_loss": mtp_value,
                    "max_expert_load": max(imbalance.tolist()),
                    "seconds": round(elapsed, 2),
                }
            )
            if not (math.isfinite(loss_value) and math.isfinite(mtp_value)):
                log(f"loss is not finite at step {step + 1}: stopping, nothing will be saved")
                status = "diverged"
                break
        # Checked before the eval, which could itself overrun: the save reserve stays intact.
        if time.perf_counter() - _T0 > stop_at:
            if step < steps - 1:
                log(
                    f"time budget: stopping after step {step + 1} of {steps} "
                    f"({seconds_left(args):.0f}s of --time-budget-s {args.time_budget_s:.0f} "
                    "left)"
                )
                status = "time budget"
            break
        if step in eval_at:
            trainer.model.eval()
            trainer.mtp.eval()
            autocast = torch.bfloat16 if trainer.device.type == "cuda" else None
            metrics = evaluate(trainer.model, trainer.mtp, heldout, args.batch_size, autocast)
            trainer.model.train()
            trainer.mtp.train()
            log(f"held-out @ step {step + 1}: " + json.dumps(metrics))
            epochs = (step + 1) * tokens_per_step / trainer.stream.numel()
            run_log.data["evals"].append({"step": step + 1, "epoch": epochs, **metrics})
            run_log.write()
    synchronize(trainer.device)
    seconds = time.perf_counter() - start
    log(f"training took {seconds:.1f}s ({status})")
    run_log.data["training"] = {
        "status": status,
        "steps_planned": steps,
        "steps_done": step + 1,
        "tokens": (step + 1) * tokens_per_step,
        "epochs": (step + 1) * tokens_per_step / trainer.stream.numel(),
        "seconds": seconds,
    }
    run_log.write()
    return status


def model_sizes(model: DeepseekV3ForCausalLM, mtp: DeepseekV3MTPLayer) -> dict[str, int]:
    """Parameter counts and checkpoint tensor bytes, in the checkpoint's own format (experts
    split, MTP copies of the embedding and head, bf16 except the routing biases). Reads shapes
    only, so the modules may live on any device, the meta device included."""
    config = model.config
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    state = split_experts(
        {**model.state_dict(), **{mtp_prefix + k: v for k, v in mtp.state_dict().items()}}
    )
    main_params = sum(t.numel() for n, t in state.items() if not n.startswith(mtp_prefix))
    stored = sum(t.numel() for t in state.values())
    layer = model.model.layers[config.first_k_dense_replace]
    return {
        "main_params": main_params,
        "mtp_params_stored": stored - main_params,
        "params_stored": stored,
        # The MTP module's embedding and head are the main model's while training.
        "params_trained": sum(
            p.numel() for p in {id(p): p for m in (model, mtp) for p in m.parameters()}.values()
        ),
        "tensor_bytes": sum(
            t.numel() * (4 if name.endswith(FP32_SUFFIXES) else 2) for name, t in state.items()
        ),
        "attention_params_per_layer": sum(p.numel() for p in layer.self_attn.parameters()),
        "moe_params_per_layer": sum(p.numel() for p in layer.mlp.parameters()),
        "dense_params_layer0": sum(p.numel() for p in model.model.layers[0].parameters()),
        "head_params": config.vocab_size * config.hidden_size,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate_samples(
    folder: Path, model: DeepseekV3ForCausalLM, max_new_tokens: int
) -> dict[str, str]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0], skip_special_tokens=True)
        log(f"greedy sample for {prompt!r}:\n{samples[prompt]}")
    return samples


def main() -> None:
    args = parse_args()
    run_log = RunLog(args.log_json)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    versions = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
    }
    log(", ".join(f"{k} {v}" for k, v in versions.items()))
    log(f"args: {json.dumps({k: str(v) for k, v in vars(args).items()})}")
    run_log.data.update(versions=versions, args={k: str(v) for k, v in vars(args).items()})
    if args.sizes_only:
        config = make_config(args.vocab_size, args.max_position_embeddings, "eager")
        with torch.device("meta"):
            model, mtp = build_model(config, torch.device("meta"))
        print(json.dumps(model_sizes(model, mtp), indent=1))
        return
    run_log.write()

    root = stdlib_root()
    train_docs, heldout_docs, skipped = read_corpus(root)
    if args.max_files is not None:
        train_docs = train_docs[: args.max_files]
        heldout_docs = heldout_docs[: max(1, args.max_files // 20)]
    train_bytes = sum(len(d.text.encode()) for d in train_docs)
    heldout_bytes = sum(len(d.text.encode()) for d in heldout_docs)
    log(
        f"corpus {root}: {len(train_docs)} train files ({train_bytes:,} bytes), "
        f"{len(heldout_docs)} held-out files ({heldout_bytes:,} bytes), "
        f"{len(skipped)} skipped as not UTF-8: {skipped}"
    )
    write_documents(args.heldout_out, heldout_docs)

    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    save_tokenizer(tokenizer, args.out, args.max_position_embeddings)
    train_stream = encode(tokenizer, train_docs)
    heldout_stream = encode(tokenizer, heldout_docs)
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}; train {train_stream.numel():,} tokens "
        f"({train_bytes / train_stream.numel():.2f} bytes/token), held-out "
        f"{heldout_stream.numel():,} tokens"
    )
    if train_stream.numel() <= args.seq_len + 1:
        raise SystemExit(f"--seq-len {args.seq_len}: the training stream is shorter than that")
    heldout = split_windows(heldout_stream, args.eval_seq_len)
    if heldout.shape[0] == 0:
        raise SystemExit(f"--eval-seq-len {args.eval_seq_len}: no held-out window that long")
    progress_heldout = subsample(heldout, args.eval_windows)
    run_log.data["corpus"] = {
        "root": str(root),
        "train_files": len(train_docs),
        "train_bytes": train_bytes,
        "heldout_files": len(heldout_docs),
        "heldout_bytes": heldout_bytes,
        "skipped": skipped,
        "vocab": tokenizer.get_vocab_size(),
        "train_tokens": train_stream.numel(),
        "heldout_tokens": heldout_stream.numel(),
    }

    experts = args.experts_implementation or ("grouped_mm" if device.type == "cuda" else "eager")
    config = make_config(tokenizer.get_vocab_size(), args.max_position_embeddings, experts)
    steps = args.steps or plan_steps(config, device, args, train_stream, run_log)
    torch.manual_seed(args.seed)
    trainer = Trainer(config, device, args, train_stream)
    try:  # a report only: never let it cost the run
        sizes = model_sizes(trainer.model, trainer.mtp)
        log(f"sizes: {json.dumps(sizes)}")
        run_log.data["sizes"] = sizes
    except Exception as error:
        log(f"could not compute the sizes: {error!r}")
    total = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    log(f"trainable parameters (embedding and head counted once): {total:,}")
    status = train(trainer, steps, progress_heldout, run_log)
    if status == "diverged":
        run_log.data["status"] = "diverged"
        run_log.write()
        raise SystemExit("training diverged; no checkpoint written (see the log)")

    save_checkpoint(args.out, trainer.model, trainer.mtp)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(args.out)
    files = {f.name: f for f in sorted(args.out.iterdir()) if f.is_file()}
    size = sum(f.stat().st_size for f in files.values())
    log(f"saved {args.out}: {sorted(files)}, {size:,} bytes")
    run_log.data["saved"] = {
        "folder": str(args.out),
        "bytes": size,
        "files": {
            name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for name, f in files.items()
        },
        "heldout_sha256": sha256(args.heldout_out),
    }
    run_log.data["status"] = "saved"
    run_log.write()

    # From here on only checks: reload what was written, as a user of the folder would. They
    # take seconds on a GPU; skipped rather than risk the budget (the CPU eval script redoes them).
    if seconds_left(args) < args.save_reserve_s:
        log(f"skipping the post-training checks: {seconds_left(args):.0f}s of the budget left")
        return
    del trainer
    model = DeepseekV3ForCausalLM.from_pretrained(
        args.out, dtype=torch.float32, experts_implementation="eager"
    ).to(device)
    mtp = load_mtp_layer(args.out, model)
    metrics = evaluate(model, mtp, heldout, args.batch_size)
    log(
        f"held-out, reloaded checkpoint, fp32, all {heldout.shape[0]} windows of "
        f"{args.eval_seq_len}: {json.dumps(metrics)}"
    )
    run_log.data["final_eval_fp32"] = metrics
    run_log.write()
    if seconds_left(args) > args.save_reserve_s / 2:
        run_log.data["samples"] = generate_samples(args.out, model, max_new_tokens=64)
    run_log.data["status"] = "done"
    run_log.write()
    log("done")


if __name__ == "__main__":
    main()
