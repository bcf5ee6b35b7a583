"""EleutherAI's lm-evaluation-harness (0.4.13, `local-completions`) against the live server,
offline, on two small tasks this test writes (a YAML task dir and jsonl data):

- a loglikelihood task (multiple choice): lm-eval sends `echo: true, logprobs: 1,
  max_tokens: 1` per choice and sums the prompt logprobs of the continuation. Oracle: the same
  token ids (lm-eval's own `_encode_pair`) through transformers' fp32 model; every per-choice
  log-likelihood within 1e-3 and every item's accuracy equal;
- a generate_until task: the harness's generations equal the server's greedy completions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_reference_model
from tests.service.server_process import ServerProcess

TOL = 1e-3
MC_ITEMS = [
    ("The quick brown", [" fox", " dog", " cat"], 0),
    ("Hello", [" world!", " you", " Paris."], 0),
    ("How are you", [" today?", " fine", " 42"], 0),
    ("The answer is", [" 42.", " Paris.", " fox."], 1),
    ("a mixture of experts routes every token to a", [" few", " small", " lazy"], 0),
    ("user: what is the capital of France? assistant:", [" Paris.", " 42.", " fine."], 0),
]
GEN_ITEMS = [("The quick brown fox", "jumps"), ("Hello world!", "How"), ("I am", "fine")]


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    mc = tasks / "mc.jsonl"
    mc.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC_ITEMS)
    )
    gen = tasks / "gen.jsonl"
    gen.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in GEN_ITEMS))
    (tasks / "tiny_mc.yaml").write_text(
        f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (tasks / "tiny_gen.yaml").write_text(
        f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )
    return tasks


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


@torch.no_grad()
def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    full = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    n = len(context)
    return sum(float(logprobs[n + i - 1, t]) for i, t in enumerate(continuation))


def test_lm_eval_local_completions(
    offline, server: ServerProcess, model_dir, model_name, openai_client, tmp_path
) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    tasks = write_tasks(tmp_path)
    model_args = {
        "model": model_name,
        "base_url": f"{server.url}/v1/completions",
        "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
    }
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    samples = results["samples"]
    assert len(samples["tiny_mc"]) == len(MC_ITEMS) and len(samples["tiny_gen"]) == len(GEN_ITEMS)

    # Loglikelihood: per choice within 1e-3 of transformers, per item the same accuracy.
    lm = LocalCompletionsAPI(**model_args)
    reference = make_reference_model(model_dir)
    for sample in sorted(samples["tiny_mc"], key=lambda s: s["doc_id"]):
        _, choices, answer = MC_ITEMS[sample["doc_id"]]
        expected = []
        assert len(sample["arguments"]) == len(choices)
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            want = hf_loglikelihood(reference, *lm._encode_pair(context, continuation))
            got = resp[0][0]
            assert abs(got - want) < TOL, (context, continuation, got, want)
            expected.append(want)
        best = max(range(len(choices)), key=expected.__getitem__)
        assert sample["acc"] == float(best == answer)
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(sum(s["acc"] for s in samples["tiny_mc"]) / len(MC_ITEMS))

    # generate_until: the harness got the server's greedy completions of the same tokens
    # (it sends token ids, as its tokenizer encodes them), cut at its stop string.
    for sample in samples["tiny_gen"]:
        question = GEN_ITEMS[sample["doc_id"]][0]
        direct = openai_client.completions.create(
            model=model_name, prompt=lm.tok_encode(question), max_tokens=8, temperature=0,
            stop=["\n"],
        )  # fmt: skip
        assert sample["resps"][0][0] == direct.choices[0].text
