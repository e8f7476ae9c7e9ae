"""Hugging Face checkpoints in and out: ``load_pretrained(path)`` and ``save_pretrained(model, path)``.

Needs only ``safetensors``; ``transformers`` is never imported by xmoe (the tests use it as the reference).
"""

from xmoe.hf.checkpoint import load_pretrained, load_weights, save_pretrained
from xmoe.hf.families import FAMILIES

__all__ = ["FAMILIES", "load_pretrained", "load_weights", "save_pretrained"]
