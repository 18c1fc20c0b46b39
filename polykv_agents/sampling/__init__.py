"""Choosing tokens: per-call settings, the per-step choice, grammars that constrain it, and text
streaming that honours stop sequences.
"""
