"""Post-training objectives on the decoder recipes' machinery (model families, LoRA, strategies, checkpoints): DPO
(``dpo.py``, its data ``preference_data.py``), and what the objectives share (``logprobs.py``)."""
