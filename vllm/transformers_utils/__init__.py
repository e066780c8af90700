"""Helpers around Hugging Face libraries (the Hub cache: hub.py)."""
