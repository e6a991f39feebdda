"""Qwen3's model: the Llama family's (its blocks norm each head's queries and keys, as its args
say: distlm.family.qwen3's config mapping turns it on)."""

from __future__ import annotations

from distlm.family.builder import Family
from distlm.family.llama.model import LlamaModel
from distlm.family.qwen3 import QWEN3

FAMILY = Family(QWEN3, LlamaModel)
