"""Engine logprobs (`{token_id: Logprob}` per generated token) in OpenAI's two response shapes.

/v1/completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a `{token: logprob}`
dict per position) and `text_offset`. /v1/chat/completions: `content`, one entry per token with
its UTF-8 `bytes` and a `top_logprobs` list. In both, the top list holds the entries ranked
1..num_top; the chosen token is always reported even when it ranks lower.

With `echo`, completions put the prompt's tokens first (from the engine's prompt logprobs): the
first prompt token has no logprob, so its `token_logprobs` and `top_logprobs` entries are null,
as vLLM returns them. `prompt_logprobs` (vLLM's extension) keeps the engine's own shape:
per prompt token None or `{token_id: {logprob, rank, decoded_token}}`.
"""

from __future__ import annotations

from mlaserve.outputs import Logprob
from mlaserve.service.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

__all__ = ["chat_logprobs", "completion_logprobs", "prompt_logprobs"]


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)


def _chosen(entry: dict[int, Logprob], token_id: int) -> tuple[str, float | None]:
    lp = entry.get(token_id)
    return (lp.decoded_token, lp.logprob) if lp is not None else ("", None)


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int = 0,
    unscored: dict[int, str] | None = None,
) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text. A None
    entry (an echoed prompt's first token) gets null logprobs; `unscored` gives its text."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            token = (unscored or {}).get(token_id, "")
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            continue
        token, logprob = _chosen(entry, token_id)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        top: dict[str, float] = {}
        for lp in _top(entry, num_top):
            top.setdefault(lp.decoded_token, lp.logprob)  # tokens may decode alike (e.g. "\ufffd")
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        token, logprob = _chosen(entry, token_id)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=logprob if logprob is not None else float("-inf"),
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token,
                        logprob=lp.logprob,
                        bytes=list(lp.decoded_token.encode("utf-8", errors="replace")),
                    )
                    for lp in _top(entry, num_top)
                ],
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in entries
    ]
