"""The LLaMA family (LLaMA-2, LLaMA-3): model, presets, Hugging Face name map, memory profile and configs."""
