"""Post-training objectives on the decoder recipes: DPO and GRPO (TRL's formats and losses)."""
