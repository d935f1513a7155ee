"""The DeepSeek-V3 / V2 family (``recipes/families.py``: ``"deepseek"``): MLA attention and DeepSeekMoE."""
