"""Canonicalize: lift exporter idioms into standard ONNX ops, whatever the target EP."""
