"""The engine core: requests, the scheduler, the model runner and the buffers every forward's
inputs live in. The step loop that composes it with the graph runner and speculative decoding is
`mlaserve/llm_engine.py`, one layer up."""
