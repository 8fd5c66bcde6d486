"""Test helpers for epfuse: tiny Hugging Face exports and reference runs (torch optional)."""
