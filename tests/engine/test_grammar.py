"""Structured output through xgrammar: sampled outputs follow the schema, the mask touches only
the rows that asked, and a bad schema is the request's error."""

from __future__ import annotations

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.llm_engine import InvalidRequestError
from mlaserve.sampling_params import SamplingParamsError, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    path = checkpoint("v3_moe")
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", page_size=4)


def test_sampled_outputs_follow_the_schema(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=so)
        for s in range(6)
    ]
    for out in llm.generate(["Hello"] * 6, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"color", "n", "ok"}
        assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 999
        assert isinstance(value["ok"], bool)


def test_json_object_is_an_object(llm: LLM) -> None:
    so = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so)
    text = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("{")


def test_the_mask_touches_only_its_rows(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    shaped = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    prompts = ["The quick brown fox", "Hello", "How are you"]
    alone = [o.outputs[0].text for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts, [plain, shaped, plain], use_tqdm=False)
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == [alone[0], alone[2]]
    assert mixed[1].outputs[0].text.startswith('{"color": "')


def test_bad_schema_is_the_requests_error(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(InvalidRequestError, match="invalid JSON schema") as e:
        llm.generate(["Hello"], bad, use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [{}, {"json": SCHEMA, "json_object": True}, {"json": 3}])
def test_params_need_exactly_one_form(kwargs) -> None:
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)
