"""Whole jobs over an output directory: the job kernel, reproduce, finetune."""
