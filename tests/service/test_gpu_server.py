"""The HTTP server on the GPU with its defaults (flashmla, fp8 KV, CUDA graphs): long prompts
through the official `openai` client do not take the engine down, and the graph metrics move
(decode replays, prefill chunks replayed from piecewise graphs).

Run on the GPU host with `python -m pytest -m gpu`.
"""

from __future__ import annotations

import pytest

from mlaserve.kernels_adapter.flashmla import flashmla_available
from tests.service.server_process import start_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashmla_available(), reason="needs an SM90 GPU and sgl-flash-mla"),
]


def test_long_prompts_through_the_server(tmp_path) -> None:
    import openai

    proc = start_server(None, tmp_path / "server.log", "--device", "cuda")
    try:
        proc.wait_ready(timeout=600)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for n in (1000, 2049, 4000):
            # Token ids that share no prefix with the other prompts: with prefix caching (on by
            # default) a shared one would be a hit, and its prompt fewer chunks.
            prompt = [(17 * i + n) % 1000 + 10 for i in range(n)]
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 8
        stream = client.completions.create(
            model=model, prompt="def fibonacci(n):", max_tokens=32, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream)
        assert text
        assert proc.get("/health").status_code == 200
        assert proc.metric("mlaserve:cuda_graph_replays_total") > 0
        # Every prefill chunk (<= max_num_batched_tokens, 2048) replays from piecewise graphs.
        assert proc.metric("mlaserve:piecewise_graph_replays_total") >= 5
        # Only start-up's warm-up request, before capture, ran its prefill eagerly.
        assert proc.metric("mlaserve:eager_steps_total", reason="extend") <= 1
        assert proc.metric("mlaserve:compiles_while_serving_total") == 0
    finally:
        assert proc.stop() == 0, proc.logs()
