"""The engine: scheduler, model runner, input buffers, and the step loop (`llm_engine.py`)."""
