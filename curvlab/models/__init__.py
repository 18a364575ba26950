from curvlab.models.gpt import CONFIGS, GPT, GPTConfig

__all__ = ["CONFIGS", "GPT", "GPTConfig"]
