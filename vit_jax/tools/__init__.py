"""The commands besides training: predict, export, visualize, few-shot, speed, TPU plans."""
