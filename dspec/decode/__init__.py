"""Decoding methods.  Each returns generated token ids per request plus statistics."""

from .generate import Generation, generate

__all__ = ["Generation", "generate"]
