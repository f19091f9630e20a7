"""Exports of a finished run: ``formats`` (merged safetensors, GGUF), the GGUF writer (``gguf``)
and ``python -m trainer export`` (``cli``).

Importing this package loads nothing (``python -m trainer`` registers the export command without torch).
"""
