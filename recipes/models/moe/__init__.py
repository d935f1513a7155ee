"""The Mixture-of-Experts decoder family: Mixtral, Qwen2-MoE and Qwen3-MoE (see ``config.py``)."""
