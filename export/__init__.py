"""HF target + draft -> ONNX bundle. Needs the ``[export]`` extra (torch, transformers, onnx)."""
