"""What every decoder LM of the recipe shares, whatever its family: data, tokenizer, LoRA, checkpoint layout,
Hugging Face conversion and the LightningModule."""
