"""Parameter files: the published .npz layout, fine-tuning surgery, a run's model, timm and
Hugging Face layouts, conversion."""
