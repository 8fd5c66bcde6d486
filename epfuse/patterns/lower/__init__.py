"""Lower: standard ONNX ops into what the chosen EP runs best, as its record allows."""
