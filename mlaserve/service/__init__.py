"""The HTTP service: an OpenAI-compatible API over the engine, with Prometheus metrics.

cli.py           `mlaserve serve`: options, uvicorn, signals and exit codes
settings.py      options from CLI > MLASERVE_* env > YAML/JSON file > defaults
app.py           FastAPI routes, middleware, lifespan
async_engine.py  the frontend of the engine process: requests in, RequestStreams out
engine_inbox.py  the engine process's messages, read on the event loop
engine_core.py   the engine process: the model, the step loop, the pipe protocol
output_wire.py   a step's outputs as tuples for the pipe   engine_errors.py  its errors
sse_chunks.py    preformatted SSE chunks (pydantic once per response, not per token)
serving.py       fan-out of a request into engine requests, submission, disconnects
completions.py   /v1/completions        chat.py   /v1/chat/completions
protocol.py      pydantic request/response bodies (protocol_common/_completions/_chat.py)
logprobs.py      logprob shapes
metrics.py       Prometheus metrics, recorded from the engine's messages
metric_families.py  the families (vLLM names, `mlaserve:` prefix), buckets, labels
auth.py          bearer API key        body_limit.py  413 for oversized bodies
errors.py        OpenAI-style error bodies and handlers
"""
