"""Offline batch inference, shaped like vLLM's `LLM` so users know it.

Example::

    from mlaserve import LLM, SamplingParams

    llm = LLM()  # the default model shipped in the package
    outs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM"]

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        unknown = set(engine_kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(
                f"LLM: unknown engine option(s) {sorted(unknown)}; "
                f"valid: {EngineConfig.field_names()}"
            )
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.engine.warmup()  # JIT and CUDA-graph capture now, not in the first generate()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        `prompts` may be one prompt or a list; a prompt is a string or a list of token ids.
        With `n > 1` a result holds n completions (seeds seed, seed+1, ... when seeded).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt, or a single one for all")

        groups: list[list[str]] = []
        for prompt, params in zip(prompts, sampling_params):
            ids = []
            for i in range(params.n):
                rid = str(next(self._ids))
                # Only final outputs are returned: the engine need not build the others (a
                # cumulative output per step copies everything generated so far).
                sub = params.replace(
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                self.engine.add_request(rid, prompt, sub)
                ids.append(rid)
            groups.append(ids)

        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
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
                )
            )
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations
        ]
        return self.generate(prompts, sampling_params)
