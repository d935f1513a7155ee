"""The Qwen2 / Qwen2.5 and Qwen3 dense family (``recipes/families.py``: ``"qwen"``)."""
