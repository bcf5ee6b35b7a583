"""Offline batch inference, shaped like vLLM's `LLM` so users know it.

Example::

    from mlaserve import LLM, SamplingParams

    llm = LLM()  # the default model shipped in the package
    outs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from mlaserve.config import EngineConfig
from mlaserve.config.model_folder import check_model_folder
from mlaserve.config.vllm_flags import engine_options
from mlaserve.llm_engine import LLMEngine
from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import RequestOutputKind, SamplingParams
from mlaserve.tokenizer import Tokenizer

__all__ = ["LLM"]

logger = logging.getLogger(__name__)

Prompt = str | list[int]
PromptInput = Prompt | dict[str, Any]  # vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """`engine_kwargs`: EngineConfig's fields, and vLLM's engine keywords with the meaning
        their `mlaserve serve` flags have (one table, `config/vllm_flags.py`):
        `enforce_eager=True` turns CUDA graphs off, `trust_remote_code` is accepted (no
        checkpoint code runs), `speculative_config={"method": "deepseek_mtp", ...}` is MTP;
        a refused one (`data_parallel_size=8`) raises ConfigError saying what to use instead."""
        options, notes = engine_options(engine_kwargs, EngineConfig.field_names())
        for note in notes:
            logger.info("vLLM keyword %s", note)
        config = EngineConfig(model=model, **options)
        # The CLI's check and words: a hub id is not downloaded; here is the command that does.
        check_model_folder(config.model_path, given=config.model is not None)
        self.engine = LLMEngine(config)
        self.engine.warmup()  # JIT and CUDA-graph capture now, not in the first generate()
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (tensor_parallel_size > 1; also
        done when the LLM is collected or the interpreter exits). Nothing on one rank."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's name); `.hf` is the transformers tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        `prompts` may be one prompt or a list; a prompt is a string, a list of token ids, or a
        vLLM prompt dict (`{"prompt": str}` or `{"prompt_token_ids": [...]}`, either with an
        optional `"cache_salt"`: prefix caching shares pages only within one salt). With `n > 1` a
        result holds n completions (seeds seed, seed+1, ... when seeded). `use_tqdm` shows a
        progress bar of finished requests (or is a callable making the tqdm bar, as in vLLM).
        If anything fails or is interrupted (Ctrl-C) before the call returns, the requests it
        added are aborted: the engine is left as the call found it.
        """
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        prompts = [_prompt_of(i, p) for i, p in enumerate(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt, or a single one for all")

        groups: list[list[str]] = []
        added: list[str] = []
        bar = None
        try:
            for prompt, params, salt in zip(prompts, sampling_params, salts):
                ids = []
                for i in range(params.n):
                    rid = str(next(self._ids))
                    # Only final outputs are returned: the engine need not build the others
                    # (a cumulative output per step copies everything generated so far).
                    sub = params.replace(
                        n=1,
                        seed=None if params.seed is None else params.seed + i,
                        output_kind=RequestOutputKind.FINAL_ONLY,
                    )
                    self.engine.add_request(rid, prompt, sub, cache_salt=salt)
                    added.append(rid)
                    ids.append(rid)
                groups.append(ids)
            if use_tqdm:
                make_bar = use_tqdm if callable(use_tqdm) else tqdm
                bar = make_bar(total=len(added), desc="Processed prompts", dynamic_ncols=True)
            final: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        results = []
        for ids in groups:
            first = final[ids[0]]
            completions = []
            for index, rid in enumerate(ids):
                completion = final[rid].outputs[0]
                completion.index = index
                completions.append(completion)
            results.append(
                RequestOutput(
                    request_id=ids[0],
                    prompt=first.prompt,
                    prompt_token_ids=first.prompt_token_ids,
                    outputs=completions,
                    finished=True,
                    metrics=first.metrics,
                    prompt_logprobs=first.prompt_logprobs,
                )
            )
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list) and generate.
        The template controls have vLLM's names and meaning."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                c,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _prompt_of(index: int, prompt: PromptInput) -> Prompt:
    """A string or token-id list as it is; a vLLM prompt dict unwrapped; anything else refused
    (a dict is never taken for text: its keys would be generated from)."""
    if isinstance(prompt, dict):
        keys = set(prompt) - {"cache_salt"}  # vLLM's prefix-cache salt (add_request checks it)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
            return prompt["prompt_token_ids"]
        raise ValueError(
            f"prompts[{index}]: a prompt dict must be {{'prompt': str}} or "
            f"{{'prompt_token_ids': list[int]}} (and optionally 'cache_salt'), got keys "
            f"{sorted(keys)}"
        )
    if isinstance(prompt, str) or (
        isinstance(prompt, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise ValueError(
        f"prompts[{index}]: must be a string, a list of token ids or a prompt dict, "
        f"got {type(prompt).__name__}"
    )
